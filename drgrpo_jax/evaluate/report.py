"""The evaluation report: per-task and overall rows (`evaluation.summarize`), as JSON, a Markdown table and
one JSON line per completion.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from drgrpo_jax.evaluate.evaluation import EvalSamples, summarize
from drgrpo_jax.evaluate.suites import Suite

__all__ = ["markdown_table", "report_rows", "write_report"]

ALL = "all"  # the row of every problem of the suite


def _take(samples: EvalSamples | None, problems: list[int]) -> EvalSamples | None:
    return None if samples is None else samples.take(problems)


def report_rows(suite: Suite, greedy: EvalSamples | None, sampled: EvalSamples | None) -> dict[str, dict[str, Any]]:
    """{task: summary} for each task of a mix (when it has several) and `all`."""
    rows: dict[str, dict[str, Any]] = {}
    tasks = suite.task_names()
    if len(tasks) > 1:
        for task in tasks:
            problems = [i for i, t in enumerate(suite.tasks) if t == task]
            rows[task] = {"problems": len(problems), **summarize(_take(greedy, problems), _take(sampled, problems))}
    rows[ALL] = {"problems": len(suite.examples), **summarize(greedy, sampled)}
    return rows


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per task: problems, greedy accuracy, avg@k, each pass@k, lengths (correct / incorrect) and
    truncation of the sampled completions (of the greedy ones when none were sampled)."""
    first = rows[ALL]
    scores = [k for k in first if "@" in k]
    lengths = "sampled/" if any(k.startswith("sampled/") for k in first) else ""
    columns = ["problems", *(["accuracy"] if "accuracy" in first else []), *scores,
               f"{lengths}response_length_correct", f"{lengths}response_length_incorrect",
               f"{lengths}truncated_fraction"]
    titles = ["task", "problems", *(["accuracy (greedy)"] if "accuracy" in first else []), *scores,
              "length correct", "length incorrect", "truncated"]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join([task, *(_cell(row.get(c)) for c in columns)]) + " |" for task, row in rows.items()]
    return "\n".join(lines)


def _json_value(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def completion_rows(suite: Suite, samples: EvalSamples, kind: str) -> list[dict[str, Any]]:
    """One JSON-ready row per completion: which problem and sample, the text, its score."""
    group = samples.correct_PG.shape[1]
    out = []
    for p, (example, task) in enumerate(zip(suite.examples, suite.tasks)):
        for g in range(group):
            out.append({"kind": kind, "problem_id": example.prompt_id, "task": task, "sample": g,
                        "question": example.question, "answer": example.answer,
                        "completion": samples.texts[p * group + g], "correct": bool(samples.correct_PG[p, g]),
                        "reward": float(samples.reward_PG[p, g]), "length": int(samples.lengths_PG[p, g]),
                        "truncated": bool(samples.truncated_PG[p, g])})
    return out


def write_report(output_dir: str, header: dict[str, Any], rows: dict[str, dict[str, Any]], suite: Suite,
                 greedy: EvalSamples | None, sampled: EvalSamples | None) -> dict[str, str]:
    """results.json, results.md and completions.jsonl in output_dir; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {name: os.path.join(output_dir, name) for name in ("results.json", "results.md", "completions.jsonl")}
    results = {**header, "results": {task: {k: _json_value(v) for k, v in row.items()} for task, row in rows.items()}}
    with open(paths["results.json"], "w") as f:
        json.dump(results, f, indent=2)
    settings = ", ".join(f"{k}={v}" for k, v in header.items() if k not in ("seconds",))
    with open(paths["results.md"], "w") as f:
        f.write(f"# Evaluation: {header.get('suite')}\n\n{settings}\n\n{markdown_table(rows)}\n")
    with open(paths["completions.jsonl"], "w") as f:
        for kind, samples in (("greedy", greedy), ("sampled", sampled)):
            for row in completion_rows(suite, samples, kind) if samples is not None else []:
                f.write(json.dumps(row) + "\n")
    return paths
