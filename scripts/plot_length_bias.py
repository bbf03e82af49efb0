"""GRPO against Dr.GRPO over seeds (benchmarks/length_bias.py): `python scripts/plot_length_bias.py SRC -o out.png`.

SRC: the OUT/length_bias.json the benchmark writes, or its record under benchmarks/results/ (record.py).
Panels against training steps: the mean length of correct responses, of incorrect ones, the training reward
and the training accuracy; per algorithm one colour, the mean over seeds as a line and the min-max band over
seeds shaded. A step where no seed has a value (no correct response at all) is a gap, not a zero.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("response_length_correct", "length of correct responses (tokens)"),
          ("response_length_incorrect", "length of incorrect responses (tokens)"),
          ("reward_mean", "training reward"),
          ("accuracy", "training accuracy"))


def load_line(path: str | pathlib.Path) -> dict:
    """The benchmark's JSON line from its own output file or from a record.py record holding it."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"plot_length_bias.py: cannot read {path}: {error}") from None
    lines = [line for line in data.get("results", [data]) if line.get("benchmark") == "length_bias"]
    if not lines or "runs" not in lines[-1]:
        raise SystemExit(f"plot_length_bias.py: {path} holds no length_bias line with runs")
    return lines[-1]


def band(series: Sequence[tuple[Sequence[int], Sequence[float | None]]]) -> dict[str, list]:
    """Mean, min and max over seeds at each step any seed reached, from each seed's (steps, values): a seed without
    a value at a step (a missing step, or null) is left out there; NaN where no seed has one."""
    by_step: dict[int, list[float]] = {}
    for steps, values in series:
        for step, value in zip(steps, values, strict=True):
            by_step.setdefault(step, [])
            if value is not None and not math.isnan(value):
                by_step[step].append(float(value))
    steps = sorted(by_step)
    nan = float("nan")
    return {"step": steps,
            "mean": [sum(by_step[s]) / len(by_step[s]) if by_step[s] else nan for s in steps],
            "min": [min(by_step[s]) if by_step[s] else nan for s in steps],
            "max": [max(by_step[s]) if by_step[s] else nan for s in steps]}


def bands(line: dict, key: str) -> dict[str, dict[str, list]]:
    """Per algorithm, the band over its seeds of curve `key`."""
    out: dict[str, list] = {}
    for run in line["runs"].values():
        out.setdefault(run["algorithm"], []).append((run["curves"]["step"], run["curves"][key]))
    return {algorithm: band(series) for algorithm, series in sorted(out.items())}


def plot(line: dict, output: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    seeds = {run["algorithm"]: 0 for run in line["runs"].values()}
    for run in line["runs"].values():
        seeds[run["algorithm"]] += 1
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        for colour, (algorithm, b) in enumerate(bands(line, key).items()):
            ax.plot(b["step"], b["mean"], color=f"C{colour}", label=f"{algorithm} (seeds: {seeds[algorithm]})")
            ax.fill_between(b["step"], b["min"], b["max"], color=f"C{colour}", alpha=0.2, linewidth=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend()
    settings = line.get("settings", {})
    fig.suptitle(f"{settings.get('model', '?')} on {settings.get('task', '?')}, budget {settings.get('budget', '?')} "
                 "tokens: mean over seeds, min-max band")
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="OUT/length_bias.json or a benchmarks/results/length_bias-*.json record")
    parser.add_argument("-o", "--output", default="length_bias.png")
    args = parser.parse_args(argv)
    plot(load_line(args.source), args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
