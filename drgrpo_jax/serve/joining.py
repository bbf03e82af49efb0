"""Continuous admission (--continuous-admission): queued rows join a running batch at its decode boundaries, in the
places of rows that finished (`sampler.generate`'s `admit_rows`), and every row is answered at the boundary after it
finishes (`finished`), so a request's latency no longer waits for the longest row of a batch it did not join.

What a running batch keeps for that: its rows in order (the ones it started with, then those that joined), where
the sampler's row ids point (its padding rows point nowhere), and which rows were answered already.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

from drgrpo_jax.sampler.batch import RowRequest

__all__ = ["Joining", "joinable"]


@dataclasses.dataclass(eq=False)
class Joining:
    """A running batch's rows and the sampler's ids for them."""

    taken: list[tuple[Any, int]]  # (request, row index) of every row, in order; rows that join are appended
    rows: list[RowRequest]  # the same rows' requests
    row_of_id: list[int | None]  # the sampler's row id -> index in `rows` (None: a padding row)
    first_version: dict[int, str] = dataclasses.field(default_factory=dict)  # joined row -> the version it joined on

    @classmethod
    def start(cls, taken: list[tuple[Any, int]], rows: list[RowRequest], device_rows: int) -> Joining:
        """A batch of `rows` padded to `device_rows` rows (the sampler's ids 0.. in that order)."""
        return cls(taken, rows, [*range(len(rows)), *[None] * (device_rows - len(rows))])

    def by_id(self, answers: Sequence[bool]) -> list[bool]:
        """Per-row answers (in `rows` order) in the sampler's id order."""
        return [False if row is None else bool(answers[row]) for row in self.row_of_id]

    def join(self, picked: list[tuple[Any, int]], version: str) -> None:
        """Appends rows that join (their ids follow every id so far, in order)."""
        for job, i in picked:
            self.first_version[len(self.rows)] = version
            self.row_of_id.append(len(self.rows))
            self.taken.append((job, i))
            self.rows.append(job.rows[i])


def joinable(pending: deque, free: int, prompt_slots: int, new_tokens: int) -> list[tuple[Any, int]]:
    """Up to `free` pending rows (in their order) that fit a running batch: a prompt within its prompt slots, a budget
    within its new tokens, no routed experts asked for (a joined row records none); left in `pending`."""
    picked: list[tuple[Any, int]] = []
    for job, i in list(pending):
        row = job.rows[i]
        if len(picked) == free:
            break
        if len(row.prompt_ids) <= prompt_slots and row.params.max_new_tokens <= new_tokens and \
                not row.return_routed_experts:
            picked.append((job, i))
    return picked
