"""A quickstart with the service's prefix cache on and off, same run: rollout seconds and prefill tokens per step.

    python benchmarks/prefix_cache_quickstart.py [--config configs/tool_quickstart.yaml] [--steps 4] [KEY=VALUE ...]

Trains --config for --steps steps twice, with no evaluation and no checkpoint, on the trainer's own child service:
with rollout.service_prefix_cache_bytes=-1 (a quarter of the service's batch budget) and with 0 (off). Prints one
JSON line: each run's median rollout seconds over the steps after the first (the first pays the compiles), the
cached run's prompt tokens per step prefilled and read from the cache (`rollout/prefix_cache_*`; with the cache off
all of them are prefilled), and the ratios on/off. The runs sample the same prompts with the same seeds; their
episodes part where a token does (the cache's log-probs agree to ~1e-5, not bit for bit).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

from rollout_engines import train


def train_rows(config: str, run_dir: pathlib.Path, overrides: list[str]) -> tuple[dict, list[dict]]:
    """(rollout_engines.train's figures, the train rows of the run's metrics.jsonl)."""
    figures = train(run_dir, overrides, config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return figures, [row for row in rows if "loss" in row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tool_quickstart.yaml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE trainer overrides for both runs")
    args = parser.parse_args()
    common = [f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=1000", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        on, on_rows = train_rows(args.config, pathlib.Path(tmp, "on"),
                                 [*common, "rollout.service_prefix_cache_bytes=-1"])
        off, _ = train_rows(args.config, pathlib.Path(tmp, "off"), [*common, "rollout.service_prefix_cache_bytes=0"])
    prefilled = [row["rollout/prefix_cache_prefilled_tokens"] for row in on_rows]
    read = [row["rollout/prefix_cache_hit_tokens"] for row in on_rows]
    rollout = {name: run["phases_s_median_after_first"]["rollout"] for name, run in (("on", on), ("off", off))}
    print(json.dumps({
        "benchmark": "prefix_cache_quickstart", "config": args.config, "steps": args.steps, "overrides": args.overrides,
        "rollout_s_median_after_first": rollout, "rollout_ratio_on_off": round(rollout["on"] / rollout["off"], 3),
        "prefilled_tokens_by_step_on": prefilled, "cached_tokens_by_step_on": read,
        "prefill_ratio_on_off": round(statistics.mean(p / (p + r) for p, r in zip(prefilled, read, strict=True)), 3),
        "reward_mean_by_step": {name: run["reward_mean_by_step"] for name, run in (("on", on), ("off", off))},
        "wall_s": {"on": on["wall_s"], "off": off["wall_s"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
