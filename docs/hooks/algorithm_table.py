"""MkDocs hook: the reference page's algorithm table, generated from `drgrpo_jax.ALGORITHMS` when the site builds,
so the page cannot drift from the table the trainer runs."""

from __future__ import annotations

from drgrpo_jax.algorithms import ALGORITHMS

MARKER = "<!-- algorithm-table -->"


def algorithm_table() -> str:
    """One Markdown row per entry: its estimator, aggregation, surrogate and forbidden options."""
    rows = ["| name | advantages | aggregation | policy loss | forbids |", "|---|---|---|---|---|"]
    for name, algorithm in ALGORITHMS.items():
        estimator = f"`{algorithm.advantage_fn.__name__}`"
        if algorithm.window_fn is not None:
            estimator += ", then whitened per optimizer window"
        forbids = ", ".join(f"`{option}`" for option in sorted(algorithm.forbids)) or "-"
        rows.append(f"| `{name}` | {estimator} | `{algorithm.aggregation}` | `{algorithm.policy_loss}` | {forbids} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs) -> str:
    return markdown.replace(MARKER, algorithm_table()) if MARKER in markdown else markdown
