"""What a run tells its operator on stderr (process 0 only): a line per start-up phase with its time, a progress
bar whose ETA counts steady-state steps only (the first step also compiles), the evaluations when they happen, and a
closing summary that names every output and its size on disk."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
from tqdm.auto import tqdm

from drgrpo_jax.weight_folders import is_remote

__all__ = ["StepBar", "closing_summary", "eval_line", "folder_bytes", "phase", "say"]

# The held-out evaluation's figures, explained where they are printed.
_EVAL_LEGEND = ("accuracy: greedy answers right; avg@k: share of k samples right; pass@k: share of problems with at "
                "least one of k samples right (unbiased estimate)")


def say(message: str) -> None:
    """One line on stderr from process 0, printed above any progress bar."""
    if jax.process_index() == 0:
        tqdm.write(f"[drgrpo] {message}", file=sys.stderr)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """`what ...` when a start-up phase begins and `what: N s` when it ends (not when it fails: its error says)."""
    say(f"{what} ...")
    start = time.perf_counter()
    yield
    say(f"{what}: {time.perf_counter() - start:.1f} s")


def eval_line(row: dict[str, Any], summary: str, *, legend: bool) -> str:
    """An evaluation's line: its step, problems and figures (`legend`: with what they mean, the first time)."""
    line = f"evaluation after step {row['step']} on {row.get('eval/num_prompts', '?')} held-out problems: {summary}"
    return f"{line}\n          ({_EVAL_LEGEND})" if legend else line


class StepBar:
    """The training bar: steps done, the latest row's figures, and an ETA from the steps after the first this
    process ran (the first compiles the step; later ones include the periodic evaluations)."""

    def __init__(self, steps: int, start_step: int):
        self._bar = tqdm(total=steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                         disable=jax.process_index() != 0, file=sys.stderr,
                         bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        self._steps, self._done = steps, start_step
        self._ends: list[float] = [time.perf_counter()]  # when each step of this process ended (and the start)

    def step_done(self, row: dict[str, Any]) -> None:
        self._done += 1
        self._ends.append(time.perf_counter())
        self._bar.set_postfix_str(f"eta {self.eta()}, reward {row['reward_mean']:.3f}, acc {row['accuracy']:.2f}, "
                                  f"{row['tokens_per_second']:.0f} tok/s", refresh=False)
        self._bar.update(1)  # draws the bar with this step's figures

    def eta(self) -> str:
        """The time left at the steady-state steps' mean ('after the next step' until there is one)."""
        steady = [b - a for a, b in zip(self._ends[1:], self._ends[2:])]
        if not steady:
            return "after the next step"
        seconds = statistics.fmean(steady) * (self._steps - self._done)
        return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> StepBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def folder_bytes(path: str) -> int | None:
    """The bytes of the files under a local folder (None for a bucket or a missing folder)."""
    if is_remote(path) or not os.path.isdir(path):
        return None
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
               if not os.path.islink(os.path.join(root, name)))


def _size(path: str) -> str:
    """'0.54 GB; ' for a local folder ('' for a bucket): the start of its parenthesis."""
    size = folder_bytes(path)
    return "" if size is None else f"{size / 1e9:.2f} GB; " if size >= 1e8 else f"{size / 1e6:.1f} MB; "


def closing_summary(output_dir: str, steps: int, seconds: float, checkpoints: list[int], *, tensorboard: bool,
                    last_eval: str | None) -> list[str]:
    """The run's last lines: what it wrote where, with sizes, and how to look at it."""
    out = output_dir
    saved = ", ".join(map(str, checkpoints)) or "none"
    lines = [f"done: {steps} steps in {seconds / 60:.1f} min",
             f"  metrics:     {os.path.join(out, 'metrics.jsonl')} (a row per step and per evaluation), "
             f"{os.path.join(out, 'samples.jsonl')}",
             f"  plot:        python scripts/plot_run.py {out} -o {os.path.basename(os.path.normpath(out))}.png",
             f"  final model: {os.path.join(out, 'final')} ({_size(os.path.join(out, 'final'))}a Hugging Face folder)",
             f"  checkpoints: {os.path.join(out, 'checkpoints')} ({_size(os.path.join(out, 'checkpoints'))}"
             f"steps {saved}; the same command resumes from the last)"]
    if tensorboard:
        lines.insert(2, f"  TensorBoard: tensorboard --logdir {os.path.join(out, 'tensorboard')}")
    if last_eval:
        lines.append(f"  last evaluation: {last_eval}")
    return lines
