"""Training curves of one or more runs, overlaid: `python scripts/plot_run.py RUN_DIR [RUN_DIR ...] -o out.png`.

Panels: reward and accuracy (training, plus the held-out greedy accuracy, avg@k and largest pass@k when
evaluated, and the tool calls per episode of a run with tools), response length split by correct and incorrect
answers, KL to the reference (or the policy's approximate KL to the rollout policy when no reference is kept), and
the gradient norm. Each run keeps one colour across panels; it is labelled by its folder name (or --labels).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from drgrpo_jax.train.run_log import read_metrics  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, skipping rows where it is absent or null."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def sampled_eval_keys(evals: list[dict]) -> list[str]:
    """The sampled evaluation's avg@k and its largest pass@k (train.eval_samples > 0), when the rows have them."""
    keys = sorted({k for row in evals for k in row if k.startswith(("eval/avg@", "eval/pass@"))})
    avg = [k for k in keys if k.startswith("eval/avg@")]
    passes = sorted((k for k in keys if k.startswith("eval/pass@")), key=lambda k: int(k.rpartition("@")[2]))
    return avg[-1:] + passes[-1:]


def _kl_key(rows: list[dict]) -> str:
    """'kl' when a reference model was used (some value non-zero), else the rollout-policy 'approx_kl'."""
    return "kl" if any(r.get("kl") for r in rows) else "approx_kl"


def plot_runs(run_dirs: Sequence[str], output: str, labels: Sequence[str] | None = None) -> None:
    """Writes the four-panel PNG comparing `run_dirs`."""
    labels = list(labels) if labels else [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"--labels: {len(labels)} labels for {len(run_dirs)} runs")
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (reward_ax, length_ax), (kl_ax, grad_ax) = axes
    for index, (run_dir, label) in enumerate(zip(run_dirs, labels)):
        train, evals = read_metrics(run_dir)
        color = f"C{index}"
        reward_ax.plot(*_series(train, "reward_mean"), color=color, label=f"{label} reward")
        reward_ax.plot(*_series(train, "accuracy"), color=color, linestyle="--", label=f"{label} accuracy")
        if any(row.get("episode/tool_calls") is not None for row in train):  # a run with tools
            reward_ax.plot(*_series(train, "episode/tool_calls"), color=color, linestyle="-.", marker="x",
                           label=f"{label} tool calls per episode")
        if evals:
            reward_ax.plot(*_series(evals, "eval/accuracy"), color=color, linestyle=":", marker="o",
                           label=f"{label} eval accuracy (greedy)")
            for key, marker in zip(sampled_eval_keys(evals), ("s", "^")):
                reward_ax.plot(*_series(evals, key), color=color, linestyle=":", marker=marker,
                               label=f"{label} eval {key.removeprefix('eval/')}")
        length_ax.plot(*_series(train, "response_length_correct"), color=color, label=f"{label} correct")
        length_ax.plot(*_series(train, "response_length_incorrect"), color=color, linestyle="--",
                       label=f"{label} incorrect")
        kl_key = _kl_key(train)
        kl_ax.plot(*_series(train, kl_key), color=color, label=f"{label} {kl_key}")
        grad_ax.plot(*_series(train, "grad_norm"), color=color, label=label)
    for ax, title, ylabel in [(reward_ax, "reward and accuracy", "fraction / reward"),
                              (length_ax, "response length by correctness", "tokens"),
                              (kl_ax, "KL", "nats per token"), (grad_ax, "gradient norm", "global norm")]:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/plot_run.py", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    parser.add_argument("-o", "--output", default="run.png", help="PNG to write (default: run.png)")
    parser.add_argument("--labels", nargs="+", help="one legend label per RUN_DIR (default: folder names)")
    args = parser.parse_args(argv)
    try:
        plot_runs(args.run_dirs, args.output, args.labels)
    except (FileNotFoundError, ValueError) as error:
        print(f"plot_run: {error}", file=sys.stderr)
        return 2
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
