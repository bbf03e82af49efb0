"""The order of training prompts: a pure function of (dataset, position, batch size, seed), so a run resumes
exactly by saving one integer, the position (batches drawn so far)."""

from __future__ import annotations

import numpy as np

from drgrpo_jax.data.examples import Example, PromptDataset
from drgrpo_jax.seeds import epoch_permutation

__all__ = ["PromptStream", "batch_at"]


def batch_at(dataset: PromptDataset, position: int, batch_size: int, seed: int) -> tuple[Example, ...]:
    """The `position`-th batch of training prompts (0-based); epochs wrap with a fresh shuffle."""
    if position < 0 or batch_size < 1:
        raise ValueError(f"batch_at: position must be >= 0 and batch_size >= 1, got {position}, {batch_size}")
    num = len(dataset.train)
    batch = []
    cache: dict[int, np.ndarray] = {}
    for k in range(position * batch_size, (position + 1) * batch_size):
        epoch, offset = divmod(k, num)
        if epoch not in cache:
            cache[epoch] = epoch_permutation(num, seed, epoch)
        batch.append(dataset.train[int(cache[epoch][offset])])
    return tuple(batch)


class PromptStream:
    """An iterator over `batch_at` whose whole state is one int (save it with the checkpoint)."""

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, position: int = 0):
        self.dataset, self.batch_size, self.seed, self.position = dataset, batch_size, seed, position

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> tuple[Example, ...]:
        batch = batch_at(self.dataset, self.position, self.batch_size, self.seed)
        self.position += 1
        return batch

    def state(self) -> int:
        """Batches drawn so far."""
        return self.position

    def restore(self, state: int) -> None:
        """Continue as if `state` batches had been drawn."""
        if isinstance(state, bool) or not isinstance(state, int) or state < 0:
            raise ValueError(f"PromptStream.restore: state must be a non-negative int, got {state!r}")
        self.position = state
