"""A training step's rollout: prompts drawn and templated, completions sampled from the generation service(s)
(each process its contiguous share), scored, gathered onto every host in prompt order; dynamic sampling's
extra rounds; and rollout.async's first rounds launched K steps ahead (`prefetch`, `prime`; the timeline is in
drgrpo_jax.train.prefetch). Every random choice derives from (run.seed, step, purpose)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import reward_weights
from drgrpo_jax.config.schema import Config, RolloutConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.data.order import batch_at
from drgrpo_jax.data.prompts import tokenize_prompt
from drgrpo_jax.environments.build import Episodes
from drgrpo_jax.environments.trajectory import run_episodes, trajectory_arrays
from drgrpo_jax.errors import ConfigError, RolloutError
from drgrpo_jax.hosts import fail_together, gather_hosts
from drgrpo_jax.rollout.record import (
    EPISODE_COLUMNS,
    HostCounters,
    ScoredRollout,
    host_share,
    merge_host_rows,
    routed_layout,
)
from drgrpo_jax.rollout.weight_push import publish_weights
from drgrpo_jax.seeds import rollout_seed
from drgrpo_jax.train.prefetch import (
    HeldRound,
    PendingRound,
    Prefetcher,
    rounds_in_flight,
    sampled_ahead,
    sampler_version,
)

if TYPE_CHECKING:
    from drgrpo_jax.step.train_step import TrainState
    from drgrpo_jax.train.setup import Run

__all__ = ["collect_rollout", "prefetch", "prime", "prompt_ids", "sample", "stop_ids"]


def _episode_opening(episodes: Episodes, example: Example) -> list[int]:
    """An episode's prompt: its environment's opening messages through the chat template (tools described)."""
    environment = episodes.make_environment()
    return episodes.renderer(environment).opening_ids(environment.reset(episodes.example(example)))


def prompt_ids(examples: tuple[Example, ...], config: Config, tokenizer: Any,
               episodes: Episodes | None) -> list[list[int]]:
    """Chat-templated prompt ids (episodes: the environment's opening); a prompt over rollout.max_prompt_tokens is
    an error naming it."""
    limit = config.rollout.max_prompt_tokens
    prompts = [_episode_opening(episodes, example) if episodes is not None else
               tokenize_prompt(example, config.data, tokenizer) for example in examples]
    for example, ids in zip(examples, prompts):
        if len(ids) > limit:
            raise ConfigError("rollout.max_prompt_tokens", f"prompt {example.prompt_id} has {len(ids)} tokens, "
                                                           f"over the limit {limit}")
    return prompts


def stop_ids(tokenizer: Any) -> list[int]:
    """The token ids that end a completion: the tokenizer's EOS, if it has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return [int(eos)] if eos is not None else []


def _version_number(version: str | None) -> int:
    """A completion's weight version as a number (generate has checked it against the expected step)."""
    if version is None:
        raise ValueError("weight_version: the generation service reported none for a completion")
    return int(version)


def _sample_episodes(run: Run, step: int, examples: tuple[Example, ...], prompts: list[list[int]], seed: int,
                     offset: int) -> tuple[ScoredRollout, HostCounters]:
    """This process's share as G multi-turn episodes per prompt (environments/trajectory.py), scored on each
    episode's last model turn; the rows hold the whole trajectory and the model's tokens in `loss_mask`."""
    r, episodes = run.config.rollout, run.episodes
    assert episodes is not None
    grouped = [e for e in examples for _ in range(r.group_size)]
    start = time.perf_counter()
    trajectories = run_episodes(run.client, run.tokenizer, episodes.make_environment,
                                [episodes.example(e) for e in grouped], limits=episodes.limits, seed=seed,
                                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, renderer=episodes.renderer,
                                expected_version=step, max_staleness=r.max_staleness,
                                first_episode=offset * r.group_size)
    rollout_seconds = time.perf_counter() - start
    for i, trajectory in enumerate(trajectories):
        if trajectory.prompt_ids != list(prompts[i // r.group_size]):
            raise RolloutError(f"episode {i}: its opening renders to other ids than the rollout's prompt "
                               "(an environment whose reset depends on more than the example?)")
    model_tokens = np.asarray([t.model_tokens for t in trajectories], np.int32)
    start = time.perf_counter()
    scored = run.scorer.score([t.final_answer for t in trajectories], grouped, model_tokens,
                              given=episodes.given_rewards(trajectories))
    counters = HostCounters(scored.functions, rollout_seconds, time.perf_counter() - start, scored.timeouts_F,
                            scored.errors_F, scored.error_messages)
    rows = trajectory_arrays(trajectories, r.max_new_tokens)
    share = ScoredRollout.from_prompts(
        examples, prompts, response_ids=rows.response_ids, behaviour_logprobs=rows.behaviour_logprobs,
        response_mask=rows.response_mask, loss_mask=rows.loss_mask,
        lengths=np.asarray([len(t.ids) for t in trajectories], np.int32),
        truncated=np.asarray([t.finish in ("max_model_tokens", "max_total_tokens") for t in trajectories]),
        weight_versions=np.asarray([min(_version_number(v) for v in t.weight_versions) for t in trajectories],
                                   np.int64),
        components=scored.components_NK,
        episodes=np.asarray([[getattr(t, column) for column in EPISODE_COLUMNS] for t in trajectories], np.float32))
    return share, counters


def _sample_share(run: Run, step: int, examples: tuple[Example, ...], prompts: list[list[int]], seed: int,
                  offset: int) -> tuple[ScoredRollout, HostCounters]:
    """This process's share of the prompts: sampled from the service(s) and scored here."""
    if run.episodes is not None:
        return _sample_episodes(run, step, examples, prompts, seed, offset)
    r = run.config.rollout
    start = time.perf_counter()
    sampled = run.client.generate(prompts, r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                  top_p=r.top_p, top_k=r.top_k,
                                  stop_token_ids=[] if r.ignore_eos else stop_ids(run.tokenizer),
                                  ignore_eos=r.ignore_eos, seed=seed,
                                  expected_version=step, max_staleness=r.max_staleness, prompt_offset=offset,
                                  first_url=jax.process_index(), return_routed_experts=run.router)
    rollout_seconds = time.perf_counter() - start
    texts = run.tokenizer.batch_decode([ids[:n] for ids, n in zip(sampled.response_ids, sampled.lengths)],
                                       skip_special_tokens=True)
    start = time.perf_counter()
    scored = run.scorer.score(texts, [e for e in examples for _ in range(r.group_size)], sampled.lengths)
    counters = HostCounters(scored.functions, rollout_seconds, time.perf_counter() - start, scored.timeouts_F,
                            scored.errors_F, scored.error_messages)
    share = ScoredRollout.from_prompts(
        examples, prompts, response_ids=sampled.response_ids, behaviour_logprobs=sampled.behaviour_logprobs,
        response_mask=sampled.response_mask, lengths=sampled.lengths, truncated=sampled.truncated,
        weight_versions=np.asarray([_version_number(v) for v in sampled.weight_versions], np.int64),
        token_versions=sampled.token_versions.astype(np.int64), components=scored.components_NK,
        **_routed(sampled.routed_experts, prompts, r.group_size, r))
    return share, counters


def _routed(experts: tuple[np.ndarray, ...] | None, prompts: list[list[int]], group_size: int,
            r: RolloutConfig) -> dict[str, np.ndarray]:
    """The share's `routed_experts` field laid out as the batch's tokens (router replay), or none."""
    if experts is None:
        return {}
    lengths = [len(prompts[n // group_size]) for n in range(len(experts))]
    return {"routed_experts": routed_layout(experts, lengths, r.max_prompt_tokens, r.max_new_tokens)}


def sample(run: Run, step: int, examples: tuple[Example, ...], prompts: list[list[int]], seed: int,
           pending: PendingRound | None = None) -> tuple[ScoredRollout, HostCounters]:
    """Each process samples and scores its share (or takes `pending`'s, sampled ahead); every process gets the
    whole rollout, in prompt order.

    A failure on any process (a reward that stops the run, a service that does not answer) is raised
    on every process together: the hosts all-gather a failure flag before the rows, so no host
    waits in a collective forever. Counters are the slowest host's times and the hosts' summed counts.
    """
    host, hosts = jax.process_index(), jax.process_count()
    start, stop = host_share(len(prompts), hosts, host)
    with fail_together(f"sampling or scoring step {step + 1}"):
        share, counters = pending.future.result() if pending is not None else _sample_share(
            run, step, examples[start:stop], prompts[start:stop], seed, start)
    stacked_rows, stacked_counters = gather_hosts((share.row_arrays(), counters.arrays()))
    if hosts > 1 and (step + 1) % run.config.run.log_every == 0:
        print(f"[process {host}/{hosts}] step {step + 1}: sampled and scored prompts {start}-{stop - 1} "
              f"({len(share.lengths)} responses)", file=sys.stderr, flush=True)
    rollout = ScoredRollout.from_prompts(examples, prompts, **merge_host_rows(stacked_rows))
    return rollout, counters.across_hosts(stacked_counters)


def collect_rollout(run: Run, step: int, pending: PendingRound | None = None, prefetcher: Prefetcher | None = None
                    ) -> tuple[ScoredRollout, np.ndarray, HostCounters, dict[str, Any]]:
    """The step's P scored groups, bool [P] which carry a learning signal, every round's counters, sampling metrics.

    With rollout.dynamic_sampling, groups without a learning signal (the algorithm's own test,
    `Algorithm.group_signal`) are dropped and up to rollout.max_resample_rounds more rollouts
    of P prompts are drawn until P groups have one; a batch still short is filled with dropped
    groups marked as padding (group_valid False: no loss, no whitening statistics), so the step
    keeps its static shapes. Every process takes the same decisions from the shared rewards. `pending`: the
    first round, sampled ahead (rollout.async); the extra rounds then queue on `prefetcher`'s thread too, behind
    the push of this step's version, so no two rounds ever sample at once.
    """
    c, r = run.config, run.config.rollout
    rounds: list[ScoredRollout] = []
    counters: list[HostCounters] = []
    signals: list[np.ndarray] = []
    while True:
        first = pending if not rounds else None
        examples = first.examples if first is not None else next(run.stream)
        prompts = first.prompts if first is not None else prompt_ids(examples, c, run.tokenizer, run.episodes)
        seed = rollout_seed(c.run.seed, step, len(rounds))
        if first is None and prefetcher is not None:
            first = _launch(run, prefetcher, step, examples, prompts, run.stream.state() - 1, seed, step)
        rollout, counted = sample(run, step, examples, prompts, seed, first)
        rounds.append(rollout)
        counters.append(counted)
        signals.append(rollout.signal_P(ALGORITHMS[c.algorithm.name], reward_weights(c)))
        with_signal = int(sum(s.sum() for s in signals))
        if not r.dynamic_sampling or with_signal >= r.prompts_per_step or len(rounds) > r.max_resample_rounds:
            break
    signal = np.concatenate(signals)
    total = sum(counters[1:], counters[0])
    metrics: dict[str, Any] = {"zero_signal_fraction": float(1.0 - signal.mean())}
    if not r.dynamic_sampling:
        return rollout, signal, total, metrics
    keep = np.flatnonzero(signal)[:r.prompts_per_step].tolist()
    fill = np.flatnonzero(~signal)[:r.prompts_per_step - len(keep)].tolist()
    metrics.update({"sampling_rounds": len(rounds), "groups_drawn": len(signal),
                    "groups_dropped": int((~signal).sum()), "groups_padded": len(fill),
                    "groups_surplus": int(signal.sum()) - len(keep)})
    chosen = ScoredRollout.concat(rounds).take(keep + fill)
    chosen = dataclasses.replace(chosen, group_valid=np.asarray([True] * len(keep) + [False] * len(fill)))
    return chosen, chosen.group_valid, total, metrics  # the kept groups have a signal, the padding ones none


def _launch(run: Run, prefetcher: Prefetcher, step: int, examples: tuple[Example, ...], prompts: list[list[int]],
            position: int, seed: int, version: int) -> PendingRound:
    """A round of step `step` queued on the sampling thread: this process's share, sampled and scored there."""
    start, stop = host_share(len(prompts), jax.process_count(), jax.process_index())
    return prefetcher.launch(step, examples, prompts, position, _sample_share, run, step, examples[start:stop],
                             prompts[start:stop], seed, start, version=version)


def prefetch(run: Run, prefetcher: Prefetcher, step: int, position: int | None = None) -> PendingRound:
    """Step `step`'s first sampling round, launched in the background now, sampled by the version the service
    holds (`sampler_version`; see train/prefetch.py): its prompts are the stream's next (or those at `position`,
    re-drawn on resume)."""
    if position is None:
        position, examples = run.stream.state(), next(run.stream)
    else:
        examples = batch_at(run.dataset, position, run.config.rollout.prompts_per_step, run.config.run.seed)
    prompts = prompt_ids(examples, run.config, run.tokenizer, run.episodes)
    return _launch(run, prefetcher, step, examples, prompts, position, rollout_seed(run.config.run.seed, step),
                   sampler_version(step, run.config.rollout.max_staleness))


def _held(run: Run, step: int, position: int, held: HeldRound) -> PendingRound:
    """A round a checkpoint holds (rollout.inflight_updates), queued back as done: its prompts re-read from its data
    position, its rows and counters as saved (one process: the share is the whole round)."""
    examples = batch_at(run.dataset, position, run.config.rollout.prompts_per_step, run.config.run.seed)
    prompts = prompt_ids(examples, run.config, run.tokenizer, run.episodes)
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result((ScoredRollout.from_prompts(examples, prompts, **held.rows), held.counters))
    return PendingRound(step, examples, prompts, position, done, int(np.min(held.rows["weight_versions"])))


def prime(run: Run, state: TrainState, prefetcher: Prefetcher) -> tuple[list[PendingRound], dict[int, Any]]:
    """The rounds queued before the first step (`rounds_in_flight`) and the params of the versions that sample them
    (version -> params, what the next checkpoints save). Fresh, version 0 samples them all; resumed, each is
    re-drawn from its saved data position by its saved version's params, pushed back for it (then the current
    ones), so the queue equals the uninterrupted run's; with rollout.inflight_updates the checkpoint holds the
    rounds themselves, queued back as done (the rounds it had not launched are sampled by the current version)."""
    c = run.config
    steps = rounds_in_flight(run.start_step, c.rollout.max_staleness, c.train.steps)
    if run.in_flight is None:
        return [prefetch(run, prefetcher, step) for step in steps], {}
    if c.rollout.inflight_updates:  # the rounds the checkpoint holds, then those its run had not launched
        held = run.in_flight.held
        queue = [_held(run, step, position, round_)
                 for step, position, round_ in zip(steps, run.in_flight.positions, held)]
        return queue + [prefetch(run, prefetcher, step) for step in steps[len(held):]], {}
    k = c.rollout.max_staleness
    params_of = {sampler_version(step, k): params
                 for step, params in zip(sampled_ahead(run.start_step, k), run.in_flight.params)}
    queue, pushed = [], run.start_step
    for step, position in zip(steps, run.in_flight.positions):
        version = sampler_version(step, k)
        if version != pushed:  # the round before is done: the service may move to this one's version
            publish_weights(run.publisher, run.client, params_of[version], version, rollback=True,
                            frozen=state.frozen, pusher=run.pusher)
            pushed = version
        queue.append(prefetch(run, prefetcher, step, position))
        prefetcher.wait(queue[-1])
    if pushed != run.start_step:
        publish_weights(run.publisher, run.client, state.params, run.start_step, frozen=state.frozen,
                        pusher=run.pusher)
    return queue, params_of
