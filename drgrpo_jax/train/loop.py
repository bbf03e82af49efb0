"""The trainer's host loop (`python -m drgrpo_jax.train --config PATH [section.key=value ...]`).

It reads top to bottom: config -> set-up (`drgrpo_jax.train.setup`) -> per step: rollout -> rewards ->
advantages -> update -> weight push -> checkpoint, each stage a call with typed inputs and outputs
(`ScoredRollout`, `Batch`, `TrainState`); the train state is returned by each step, never changed in place.
Every random choice derives from (run.seed, step), and the data position and weight version are checkpointed
with the train state, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from tqdm.auto import tqdm

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import one_window_per_rollout, reward_weights
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import Preempted
from drgrpo_jax.evaluate.evaluation import EvalSettings, eval_metrics, eval_summary
from drgrpo_jax.host_memory import peak_rss_gb, return_freed_memory, returning_compile_memory
from drgrpo_jax.hosts import fail_together, host_array
from drgrpo_jax.rollout.weight_push import publish_weights
from drgrpo_jax.seeds import eval_seed, minibatch_permutation
from drgrpo_jax.sharding import batch_sharding, place
from drgrpo_jax.train.collect import collect_rollout, prefetch, prime, prompt_ids, stop_ids
from drgrpo_jax.train.hub import model_card, push_folder
from drgrpo_jax.train.metrics import UpdateResult, sample_rows, step_metrics
from drgrpo_jax.train.prefetch import (
    PendingRound,
    Prefetcher,
    check_fresh,
    held_contents,
    push_waits_for,
    queue_length,
    sampled_ahead,
    sampler_version,
    saved_params,
    snapshot,
)
from drgrpo_jax.train.setup import Run, setup
from drgrpo_jax.weight_folders import copy_folder, remove_folder, scratch_folder

if TYPE_CHECKING:
    from drgrpo_jax.step.batch import Batch
    from drgrpo_jax.step.train_step import TrainState

__all__ = ["train", "train_one_step", "update"]


# ---------------------------------------------------------------------------------------------
# Update
# ---------------------------------------------------------------------------------------------


def update(run: Run, state: TrainState, step: int, batch: Batch,
           signal_N: np.ndarray) -> tuple[TrainState, UpdateResult]:
    """Old log-probs (when several windows share the rollout), then ppo_epochs x minibatches_per_rollout
    optimizer windows: (new state, their report).

    Each window's advantages pass the algorithm's window step (`Algorithm.window_advantages`) on its own rows.
    """
    a = run.config.algorithm
    algorithm = ALGORITHMS[a.name]
    start = time.perf_counter()
    if not one_window_per_rollout(a):  # else the step uses its own forward's log-probs (StepConfig.on_policy)
        old_logprobs = host_array(run.logprob_fn(state.params, place(batch, batch_sharding(run.mesh)), state.frozen))
        batch = dataclasses.replace(batch, old_logprobs=old_logprobs)
    old_logprob_seconds = time.perf_counter() - start
    num = batch.row_valid.shape[0]
    size = num // a.minibatches_per_rollout
    history, window_reports = [], []
    for epoch in range(a.ppo_epochs):
        order = minibatch_permutation(num, run.config.run.seed, step, epoch)
        for m in range(a.minibatches_per_rollout):
            rows = order[m * size:(m + 1) * size]
            window = jax.tree.map(lambda v, rows=rows: v[rows], batch)
            advantages, report = algorithm.window_advantages(window.advantages, window.row_valid, signal_N[rows])
            window = dataclasses.replace(window, advantages=np.asarray(advantages, np.float32))
            window_reports.append({k: float(v) for k, v in report.items()})
            state, metrics = run.train_fn(state, place(window, batch_sharding(run.mesh)))
            history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return state, UpdateResult(history, window_reports, old_logprob_seconds)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Ahead:
    """rollout.async: the queue of rounds sampled ahead (oldest first, at most K = rollout.max_staleness) and the
    params of the versions that sample them (version -> a copy: what a checkpoint taken while they are queued
    saves); the main thread changes it, step by step."""

    prefetcher: Prefetcher
    queue: collections.deque[PendingRound]
    params_of: dict[int, Any]
    deferred: bool = False  # the pushes queue on the sampling thread (train/prefetch.py: K > 1, one host, no base)
    inflight: bool = False  # rollout.inflight_updates: a push reaches the rounds sampling, so it waits for none
    pushes: list[concurrent.futures.Future] = dataclasses.field(default_factory=list)  # deferred, not yet checked

    def check_pushes(self, *, wait: bool = False) -> None:
        """Raises a deferred push's error here, on the update loop (`wait`: first waits for every push, and so
        for every round queued before the last: the service then holds the newest version)."""
        if wait and self.pushes:
            concurrent.futures.wait(self.pushes)
        for push in [p for p in self.pushes if p.done()]:
            push.result()
            self.pushes.remove(push)


def defers_push(config: Config, frozen: Any) -> bool:
    """Whether the pushes queue on the sampling thread: K > 1 (with K = 1 the next step needs the pushed version's
    round at once), one process (a push is a collective of every host, kept on the update loop) and no frozen
    LoRA base (the update donates it, so a queued push could not read it); never with rollout.inflight_updates,
    whose pushes wait for no round."""
    return (config.rollout.max_staleness > 1 and jax.process_count() == 1 and frozen is None
            and not config.rollout.inflight_updates)


def _sample_ahead(run: Run, state: TrainState, step: int, ahead: Ahead) -> None:
    """Launches the round K steps ahead (the service holds version `step`) and keeps version `step`'s params while
    a checkpoint may need them: with K = 1 on checkpoint steps only, with K > 1 always (a preemption can save any
    step), the last K versions; with rollout.inflight_updates none (a checkpoint holds the rounds themselves)."""
    c, k = run.config, run.config.rollout.max_staleness
    keeps = k > 1 or run.checkpointer.due(step + 1, force=step + 1 == c.train.steps)
    if not ahead.inflight and step not in ahead.params_of and keeps:
        ahead.params_of[step] = snapshot(state.params)
    for version in [v for v in ahead.params_of if v < sampler_version(step + 1, k)]:
        del ahead.params_of[version]  # no checkpoint after this step holds a round it samples
    if step + k < c.train.steps:
        ahead.queue.append(prefetch(run, ahead.prefetcher, step + k))


def checkpoint_contents(run: Run, state: TrainState, steps_done: int,
                        ahead: Ahead | None) -> tuple[Any, dict[str, Any], Any]:
    """(the saved trees, the host JSON, the held rounds or None) after `steps_done` steps; with rollout.async also
    the queue: its rounds' data positions and the params of the versions that sample them (`train.prefetch.InFlight`),
    or with rollout.inflight_updates the rounds themselves, once done (`held_contents`)."""
    host: dict[str, Any] = {"step": steps_done, "data_position": run.stream.state(), "weight_version": steps_done,
                            "rollout_queue": queue_length(ahead is not None, run.config.rollout.max_staleness)}
    if ahead is None:
        return state.checkpointed(), host, None
    if ahead.inflight:
        rounds, held = held_contents(ahead.queue)
        host.update(held, stream_position=run.stream.state())
        return state.checkpointed(), host, rounds
    k, position = run.config.rollout.max_staleness, run.stream.state()
    positions = [p.data_position for p in ahead.queue]
    positions += range(position, position + k - len(positions))  # not launched (the run ends): the next prompts
    params = [ahead.params_of[sampler_version(t, k)] for t in sampled_ahead(steps_done, k)]
    host.update(data_position=positions[0], round_positions=positions, stream_position=position)
    return (state.checkpointed(), saved_params(params, k)), host, None


def train_one_step(run: Run, state: TrainState, step: int,
                   ahead: Ahead | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Step `step` (0-based): rollout -> rewards -> advantages -> update -> weight push; (new state, metrics row).

    Every process samples G completions of its contiguous share of the P prompts from the generation service(s)
    (the local child unless rollout.urls is set; several hosts need rollout.urls) and scores them, and the hosts
    all-gather the rows in prompt order (`train.collect`); the old log-probs are recomputed, ppo_epochs x
    minibatches_per_rollout jitted updates run, and the new weights go to every service (`rollout.weight_push`).
    With rollout.async (`ahead`) the step takes its first round from the queue and launches the round K steps
    ahead, sampled during the update (`train.prefetch`).
    """
    c = run.config
    started = time.perf_counter()
    pending = ahead.queue.popleft() if ahead is not None else None
    Prefetcher.wait(pending)
    take_seconds = time.perf_counter() - started
    if ahead is not None:
        ahead.check_pushes()
    rollout, signal_P, counters, sampling = collect_rollout(run, step, pending,
                                                            None if ahead is None else ahead.prefetcher)
    check_fresh(rollout.weight_versions, step, c.rollout.max_staleness)  # never trains on a rollout older than allowed
    advantages_N = rollout.advantages_N(ALGORITHMS[c.algorithm.name], reward_weights(c),
                                        scale_rewards=c.algorithm.scale_rewards,
                                        whiten_advantages=c.algorithm.whiten_advantages)
    batch = rollout.to_batch(advantages_N, c.rollout.max_prompt_tokens)
    signal_N = np.repeat(signal_P, rollout.group_size)
    if ahead is not None:
        _sample_ahead(run, state, step, ahead)
    train_start = time.perf_counter()
    state, updates = update(run, state, step, batch, signal_N)
    wait_start = time.perf_counter()
    if ahead is not None and not (ahead.deferred or ahead.inflight):  # the service leaves this version once the
        # rounds it samples are done (in flight: it takes the push between their decode phases)
        for i in push_waits_for([p.version for p in ahead.queue], step):
            Prefetcher.wait(ahead.queue[i])
    push_start = time.perf_counter()
    if ahead is not None and ahead.deferred:  # queued behind those rounds, from a copy the next update cannot donate
        params = ahead.params_of[step + 1] = snapshot(state.params)
        ahead.pushes.append(ahead.prefetcher.submit(functools.partial(
            publish_weights, run.publisher, run.client, params, step + 1, pusher=run.pusher)))
    else:
        publish_weights(run.publisher, run.client, state.params, step + 1, frozen=state.frozen, pusher=run.pusher)
    now = time.perf_counter()
    seconds = {"train": wait_start - train_start, "wait": push_start - wait_start, "push": now - push_start,
               "step": now - started}
    row = step_metrics(c, step + 1, rollout, batch, counters, updates, seconds)
    row.update(sampling, data_position=run.stream.state(), service_restarts=run.client.service_restarts,
               peak_rss_gb=peak_rss_gb())
    if ahead is not None:
        row.update(queue_depth=len(ahead.queue), consumer_idle_seconds=take_seconds + seconds["wait"],
                   producer_idle_seconds=ahead.prefetcher.idle_seconds(started, now))
    if run.log.enabled and c.run.sample_every and (step + 1) % c.run.sample_every == 0:
        run.log.samples(sample_rows(c, run.tokenizer, step + 1, rollout))
    return state, row


def periodic_eval(run: Run, step: int) -> dict[str, Any] | None:
    """Greedy accuracy, avg@k and pass@k on the held-out split after `step` steps: process 0 evaluates (None elsewhere).

    The other processes wait for it (and raise with it if it fails), so none runs ahead into the
    next step's collectives.
    """
    row = None
    with fail_together(f"evaluation after step {step}"):
        if jax.process_index() == 0 and run.dataset.eval:
            row = _periodic_eval(run, step)
    return row


def _periodic_eval(run: Run, step: int) -> dict[str, Any]:
    """periodic_eval's work on process 0: greedy and train.eval_samples sampled completions (evaluate.evaluation)."""
    c = run.config
    start = time.perf_counter()
    settings = EvalSettings(max_new_tokens=c.rollout.max_new_tokens, samples=c.train.eval_samples,
                            temperature=c.train.eval_temperature, seed=eval_seed(c.run.seed, step),
                            chunk_prompts=max(len(run.dataset.eval), 1))
    prompts = prompt_ids(run.dataset.eval, c, run.tokenizer, run.episodes)
    row = eval_metrics(run.client, run.tokenizer, run.scorer, run.dataset.eval, prompts, settings,
                       stop_token_ids=stop_ids(run.tokenizer), expected_version=step, episodes=run.episodes)
    return {"step": step, **row, "eval_seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------
# The loop and the command line
# ---------------------------------------------------------------------------------------------


def _progress(steps: int, start_step: int) -> Any:
    """A tqdm bar on process 0 (a no-op object elsewhere)."""
    return tqdm(total=steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                disable=jax.process_index() != 0, file=sys.stderr)


def train(config: Config, command: str = "") -> str:
    """Runs (or resumes) the configured training; returns the run directory. `command`: the command line that
    started it, for the model card of run.push_to_hub.

    It holds config.yaml (resolved), metrics.jsonl (one row per step; eval rows carry `eval/*` keys instead of
    `loss`), samples.jsonl, tensorboard/, checkpoints/, weights/, serve.log and final/ (an HF folder of the last
    policy; with LoRA a PEFT adapter folder).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(returning_compile_memory())
        run, state = setup(config, stack)
        c = run.config
        bar = stack.enter_context(_progress(c.train.steps, run.start_step))
        if run.log.enabled:  # process 0; beside the progress bar on stderr
            print(f"model.compute_dtype: {run.compute_dtype} (GEMMs of the train step and the local service)",
                  file=sys.stderr, flush=True)
        last_eval = None  # the model card's evaluation table
        if c.train.eval_every and run.start_step == 0:
            if (row := periodic_eval(run, 0)) is not None:
                run.log.metrics(row)
                last_eval = row
        return_freed_memory()  # what loading and dequantising the weights freed
        ahead = None
        if c.rollout.async_:
            prefetcher = stack.enter_context(Prefetcher())
            queue, params_of = prime(run, state, prefetcher) if run.start_step < c.train.steps else ([], {})
            ahead = Ahead(prefetcher, collections.deque(queue), params_of, defers_push(c, state.frozen),
                          inflight=c.rollout.inflight_updates)
        for step in range(run.start_step, c.train.steps):
            state, row = train_one_step(run, state, step, ahead)
            run.log.metrics(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                            tok_s=f"{row['tokens_per_second']:.0f}", refresh=False)
            if (step + 1) % c.run.log_every == 0:
                bar.write(f"step {step + 1}/{c.train.steps} reward {row['reward_mean']:.3f} "
                          f"accuracy {row['accuracy']:.3f} loss {row['loss']:.4g} kl {row['kl']:.3g} "
                          f"length {row['response_length_mean']:.1f} {row['tokens_per_second']:.0f} tok/s")
            if c.train.eval_every and ((step + 1) % c.train.eval_every == 0 or step + 1 == c.train.steps):
                if ahead is not None:  # evaluation samples alone, from the version just pushed
                    ahead.check_pushes(wait=True)
                if (eval_row := periodic_eval(run, step + 1)) is not None:
                    run.log.metrics(eval_row)
                    last_eval = eval_row
                    bar.write(f"step {step + 1} eval " + eval_summary(eval_row))
            if run.checkpointer.due(step + 1, force=step + 1 == c.train.steps):
                trees, host, rounds = checkpoint_contents(run, state, step + 1, ahead)
                run.checkpointer.save(step + 1, trees, host, force=step + 1 == c.train.steps, rounds=rounds)
            if step + 1 < c.train.steps and run.checkpointer.preempted(step + 1):  # saved above, on every process
                bar.write(f"preempted: saved step {step + 1}; the same command resumes it")
                raise Preempted(step + 1)  # leaving the stack flushes the run log and stops the services
            return_freed_memory()
        if ahead is not None:  # the last deferred push is done (or its error raised) before the run ends
            ahead.check_pushes(wait=True)
        final = os.path.join(c.run.output_dir, "final")
        local_final = os.path.join(scratch_folder(c.run.output_dir), "final")  # final itself unless on a bucket
        run.publisher.export(state.params, local_final, tokenizer=run.tokenizer)  # with LoRA: the PEFT adapter
        if state.frozen is not None and c.model.lora.export_merged:
            run.publisher.export_merged(state.params, state.frozen, os.path.join(local_final, "merged"), run.tokenizer)
        if c.run.push_to_hub and run.log.enabled:
            card = model_card(c, command=command, evaluation=last_eval, repo_id=c.run.push_to_hub)
            url = push_folder(local_final, c.run.push_to_hub, private=c.run.hub_private, card=card)
            bar.write(f"pushed {final} to the Hub with its model card: {url}")
        if local_final != final and jax.process_index() == 0:  # process 0 exported it (with the card)
            remove_folder(final)  # what an earlier export left there
            copy_folder(local_final, final)
        bar.write(f"done: {c.train.steps} steps; policy exported to {final}")
    return c.run.output_dir

