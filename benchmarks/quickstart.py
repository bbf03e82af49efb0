"""README command 1's training job, timed whole: wall time, per-step phases, learning curve, peak memory.

    python benchmarks/quickstart.py [--config configs/quickstart.yaml] [--keep DIR] [KEY=VALUE ...]

Runs `python -m drgrpo_jax.train --config CONFIG run.output_dir=<temp> KEY=VALUE...` in its own
process and prints one JSON line: the job's wall time (model load, compiles and evals included), the
median seconds of a step after the first and of its phases (rollout, reward, update, weight push),
the training reward and greedy accuracy curves from the run's metrics.jsonl (a run with tools: its episodes'
tool calls, malformed calls and model tokens by step too; sampled evaluations: avg@k), the peak RSS of the
largest process (trainer or its generation service) and the trainer's own (metrics' peak_rss_gb), and
the GEMM dtype the trainer resolved model.compute_dtype to.
No peer: the same shape through TRL is `benchmarks/rl_step.py`'s job.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return round(statistics.median(values), 2) if values else None


def summarise(rows: list[dict]) -> dict:
    """The figures of one run from its metrics.jsonl rows (train rows carry `loss`, eval rows `eval/*`)."""
    train = [row for row in rows if "loss" in row]
    evals = [row for row in rows if any(key.startswith("eval/") for key in row)]
    later = train[1:]  # the first step pays the compiles
    episodes = {key: [round(row[key], 3) for row in train]  # a run with tools: its episodes' means by step
                for key in ("episode/tool_calls", "episode/malformed_calls", "episode/model_tokens")
                if train and all(row.get(key) is not None for row in train)}
    sampled = {key: {row["step"]: round(row[key], 3) for row in evals if key in row}  # eval/avg@k, k sampled
               for key in sorted({key for row in evals for key in row if key.startswith("eval/avg@")})}
    return {
        "steps": len(train),
        "step_s_median_after_first": _median(later, "step_seconds"),
        "phases_s_median_after_first": {phase: _median(later, f"{phase}_seconds")
                                        for phase in ("rollout", "reward", "train", "push")},
        "reward_mean_by_step": [round(row["reward_mean"], 3) for row in train],
        "trainer_peak_rss_gb": train[-1].get("peak_rss_gb") if train else None,  # the trainer process alone
        "eval_accuracy_by_step": {row["step"]: round(row["eval/accuracy"], 3)
                                  for row in evals if "eval/accuracy" in row},
        **{f"{key.removeprefix('episode/')}_by_step": values for key, values in episodes.items()},
        **{f"{key.removeprefix('eval/')}_by_step": values for key, values in sampled.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (final model, metrics)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE trainer overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(args.keep) if args.keep else pathlib.Path(tmp, "run")
        command = [sys.executable, "-m", "drgrpo_jax.train", "--config", args.config,
                   f"run.output_dir={run_dir}", *args.overrides]
        start = time.perf_counter()
        finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        if finished.returncode != 0:
            print(finished.stderr[-4000:], file=sys.stderr)
            return finished.returncode
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resolved = re.search(r"model\.compute_dtype: (\w+)", finished.stderr)  # the progress bar may share its line
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    print(json.dumps({"benchmark": "quickstart", "config": args.config, "overrides": args.overrides,
                      "compute_dtype": resolved.group(1) if resolved else None, "wall_s": round(wall, 1),
                      **summarise(rows), "peak_rss_gb": round(peak_gb, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
