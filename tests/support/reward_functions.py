"""The test rewards a trainer child imports by path (`reward.functions=[support.reward_functions:NAME]`, with
tests/ on its PYTHONPATH), so they live here rather than in a test module the child cannot import."""

from __future__ import annotations

import os


def has_letter_a(completion: str, example) -> float:
    """A reward a random model earns on some completions and misses on others."""
    return 1.0 if "a" in completion else 0.0


def letters(completion: str, example) -> dict[str, float]:
    """Three components from one reward call (GDPO); the trainer uses two of them (reward.components)."""
    return {"has_letter_a": float("a" in completion), "count_b": float(completion.count("b")), "unused": 1.0}


def recorded_letter_a(completion: str, example) -> float:
    """has_letter_a, recording which trainer process (the reward worker's parent) scored what: one line per
    prompt id in REWARD_RECORD_DIR/PARENT_PID.txt when that variable is set."""
    folder = os.environ.get("REWARD_RECORD_DIR")
    if folder:
        with open(os.path.join(folder, f"{os.getppid()}.txt"), "a") as f:
            f.write(f"{example.prompt_id}\n")
    return 1.0 if "a" in completion else 0.0


def nan_on_flagged_host(completion: str, example) -> float:
    """A reward that stops the run (NaN) on the host whose environment sets FAIL_REWARD, and only there."""
    return float("nan") if os.environ.get("FAIL_REWARD") else 1.0


def nan_once_flagged(completion: str, example) -> float:
    """A reward that stops the run (NaN) once the file named by FAIL_REWARD_FILE exists (a test creates it mid-run)."""
    return float("nan") if os.path.exists(os.environ.get("FAIL_REWARD_FILE", "")) else 1.0
