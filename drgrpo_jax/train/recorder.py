"""What records a run: its checkpoints (with the rollout queue's record), metrics.jsonl and samples.jsonl, and the
final export (with the Hub push)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import jax

from drgrpo_jax.checkpoint import Checkpointer
from drgrpo_jax.train.hub import model_card, push_folder
from drgrpo_jax.train.metrics import sample_rows
from drgrpo_jax.train.run_log import RunLog
from drgrpo_jax.weight_folders import copy_folder, remove_folder, scratch_folder

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import Config
    from drgrpo_jax.rollout.record import ScoredRollout
    from drgrpo_jax.rollout.weight_push import WeightPublisher
    from drgrpo_jax.step.train_step import TrainState
    from drgrpo_jax.train.rollout_queue import RolloutQueue

__all__ = ["Recorder"]


@dataclasses.dataclass(frozen=True)
class Recorder:
    """The run's outputs under run.output_dir; `log.enabled` on process 0 only."""

    config: Config
    checkpointer: Checkpointer
    log: RunLog
    publisher: WeightPublisher  # the final export (the pushes are the queue's)
    tokenizer: Any  # saved with the final model
    start_step: int  # 0, or the checkpoint's step when resuming
    compute_dtype: str  # model.compute_dtype made concrete for this device

    def samples(self, step: int, rollout: ScoredRollout) -> None:
        """samples.jsonl's rows every run.sample_every steps (process 0)."""
        every = self.config.run.sample_every
        if self.log.enabled and every and step % every == 0:
            self.log.samples(sample_rows(self.config, self.tokenizer, step, rollout))

    def save(self, state: TrainState, steps_done: int, queue: RolloutQueue) -> None:
        """A checkpoint after `steps_done` steps when one is due (the last step always), with the queue's record."""
        last, optimizer = steps_done == self.config.train.steps, self.config.train.checkpoint_optimizer
        if self.checkpointer.due(steps_done, force=last):
            trees, record, rounds = queue.checkpoint(state.checkpointed(optimizer=optimizer), steps_done)
            record = dataclasses.replace(record, optimizer_state=optimizer)
            self.checkpointer.save(steps_done, trees, record.host(), force=last, rounds=rounds)

    def export(self, state: TrainState, last_eval: dict[str, Any] | None, command: str) -> list[str]:
        """final/ (an HF folder; with LoRA the PEFT adapter, and merged/ with model.lora.export_merged), pushed to
        the Hub with its model card under run.push_to_hub (the line to print, or none)."""
        c, lines = self.config, []
        final = os.path.join(c.run.output_dir, "final")
        local_final = os.path.join(scratch_folder(c.run.output_dir), "final")  # final itself unless on a bucket
        self.publisher.export(state.params, local_final, tokenizer=self.tokenizer)
        if state.frozen is not None and c.model.lora.export_merged:
            self.publisher.export_merged(state.params, state.frozen, os.path.join(local_final, "merged"),
                                         self.tokenizer)
        if c.run.push_to_hub and self.log.enabled:
            card = model_card(c, command=command, evaluation=last_eval, repo_id=c.run.push_to_hub)
            url = push_folder(local_final, c.run.push_to_hub, private=c.run.hub_private, card=card)
            lines.append(f"pushed {final} to the Hub with its model card: {url}")
        if local_final != final and jax.process_index() == 0:  # process 0 exported it (with the card)
            remove_folder(final)  # what an earlier export left there
            copy_folder(local_final, final)
        return lines
