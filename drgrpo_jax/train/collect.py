"""One sampling round of a training step: each process samples and scores its contiguous share of the prompts
(`Actor.sample_and_score`), and the hosts gather the rows in prompt order; `RoundSource` draws the rounds' prompts.
Which rounds are sampled when, and on which thread, is the rollout queue's (train/rollout_queue.py)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import jax

from drgrpo_jax.actor.actor import GroupSampling
from drgrpo_jax.data.order import batch_at
from drgrpo_jax.hosts import fail_together, gather_hosts
from drgrpo_jax.rollout.record import HostCounters, ScoredRollout, host_share, merge_host_rows
from drgrpo_jax.seeds import rollout_seed

if TYPE_CHECKING:
    from drgrpo_jax.actor.actor import Actor
    from drgrpo_jax.config.schema import Config
    from drgrpo_jax.data.examples import Example, PromptDataset
    from drgrpo_jax.data.order import PromptStream

__all__ = ["Round", "RoundSource", "gather_round", "sample_share", "taken_together", "training_sampling"]


def training_sampling(config: Config) -> GroupSampling:
    """How a training round samples: rollout.group_size completions at the rollout's settings."""
    r = config.rollout
    return GroupSampling(group=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, ignore_eos=r.ignore_eos, max_staleness=r.max_staleness)


@dataclasses.dataclass(frozen=True)
class Round:
    """A sampling round's prompts: what its share samples, and where the stream drew them (a checkpoint saves it)."""

    step: int  # the step (0-based) that trains on it
    index: int  # 0: the step's first round; more: dynamic sampling's extra rounds
    examples: tuple[Example, ...]
    prompts: list[list[int]]
    data_position: int

    @property
    def share(self) -> tuple[int, int]:
        """This process's contiguous share of the prompts: [start, stop)."""
        return host_share(len(self.prompts), jax.process_count(), jax.process_index())


@dataclasses.dataclass
class RoundSource:
    """Draws rounds: the next prompts of the stream (whose position is the run's data position), or those at a saved
    position (a resumed queue), templated by the actor."""

    config: Config
    actor: Actor
    stream: PromptStream
    dataset: PromptDataset

    def next(self, step: int, index: int = 0) -> Round:
        position, examples = self.stream.state(), next(self.stream)
        return self._round(step, index, examples, position)

    def at(self, step: int, position: int) -> Round:
        """Step `step`'s first round as drawn at `position` (re-drawn on resume)."""
        c = self.config
        return self._round(step, 0, batch_at(self.dataset, position, c.rollout.prompts_per_step, c.run.seed),
                           position)

    def _round(self, step: int, index: int, examples: tuple[Example, ...], position: int) -> Round:
        c = self.config
        return Round(step, index, examples, self.actor.prompt_ids(examples, c.data, c.rollout.max_prompt_tokens),
                     position)


def sample_share(actor: Actor, config: Config, round_: Round) -> tuple[ScoredRollout, HostCounters]:
    """This process's share of a round, sampled from the service(s) and scored here, as the rollout record."""
    start, stop = round_.share
    examples, prompts = round_.examples[start:stop], round_.prompts[start:stop]
    scored = actor.sample_and_score(examples, prompts, training_sampling(config),
                                    seed=rollout_seed(config.run.seed, round_.step, round_.index),
                                    expected_version=round_.step, prompt_offset=start, first_url=jax.process_index(),
                                    record_prompt_tokens=config.rollout.max_prompt_tokens)
    assert scored.rows is not None
    return ScoredRollout.from_prompts(examples, prompts, **scored.rows), scored.counters


def gather_round(round_: Round, share: tuple[ScoredRollout, HostCounters], log_every: int
                 ) -> tuple[ScoredRollout, HostCounters]:
    """Every process's share gathered onto every host, in prompt order. Counters: the slowest host's times and the
    hosts' summed counts."""
    rows, counters = share
    stacked_rows, stacked_counters = gather_hosts((rows.row_arrays(), counters.arrays()))
    host, hosts = jax.process_index(), jax.process_count()
    if hosts > 1 and (round_.step + 1) % log_every == 0:
        start, stop = round_.share
        print(f"[process {host}/{hosts}] step {round_.step + 1}: sampled and scored prompts {start}-{stop - 1} "
              f"({len(rows.lengths)} responses)", file=sys.stderr, flush=True)
    rollout = ScoredRollout.from_prompts(round_.examples, round_.prompts, **merge_host_rows(stacked_rows))
    return rollout, counters.across_hosts(stacked_counters)


def taken_together(round_: Round, share: tuple[ScoredRollout, HostCounters] | BaseException, log_every: int
                   ) -> tuple[ScoredRollout, HostCounters]:
    """`gather_round` once every host has its share: a failure on any process (a reward that stops the run, a
    service that does not answer) is raised on every process together, since the hosts all-gather a failure flag
    before the rows, so no host waits in a collective forever."""
    with fail_together(f"sampling or scoring step {round_.step + 1}"):
        if isinstance(share, BaseException):
            raise share
    return gather_round(round_, share, log_every)
