"""The trainer's host loop (`python -m drgrpo_jax.train --config PATH [section.key=value ...]`).

It reads top to bottom: config -> set-up (`drgrpo_jax.train.setup`) -> per step: rollout -> rewards ->
advantages -> update -> weight push -> checkpoint, each stage a call with typed inputs and outputs
(`ScoredRollout`, `Batch`, `TrainState`); the train state is returned by each step, never changed in place.
Every random choice derives from (run.seed, step), and the data position and weight version are checkpointed
with the train state, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from drgrpo_jax.train.prefetch import PendingRound, Prefetcher, check_fresh, snapshot
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


@dataclasses.dataclass(frozen=True)
class Ahead:
    """rollout.async: the next step's round sampled during this step, and what a checkpoint after it needs."""

    pending: PendingRound | None  # None after the last step
    data_position: int  # the prompt stream's position before the pending round's prompts
    behaviour_params: Any = None  # the params that sample the pending round (copied on checkpoint steps only)


def train_one_step(run: Run, state: TrainState, step: int, prefetcher: Prefetcher | None = None,
                   pending: PendingRound | None = None) -> tuple[TrainState, dict[str, Any], Ahead | None]:
    """Step `step` (0-based): rollout -> rewards -> advantages -> update -> weight push; (new state, metrics row,
    with a `prefetcher` (rollout.async) the next step's round, sampled while the update ran).

    Every process samples G completions of its contiguous share of the P prompts from the generation service(s)
    (the local child unless rollout.urls is set; several hosts need rollout.urls) and scores them, and the hosts
    all-gather the rows in prompt order (`train.collect`); the old log-probs are recomputed, ppo_epochs x
    minibatches_per_rollout jitted updates run, and the new weights go to every service (`rollout.weight_push`).
    With rollout.async the next step's rollout is sampled during the update, one version stale (`train.prefetch`).
    """
    c = run.config
    started = time.perf_counter()
    rollout, signal_P, counters, sampling = collect_rollout(run, step, pending)
    check_fresh(rollout.weight_versions, step, c.rollout.max_staleness)  # never trains on a rollout older than allowed
    advantages_N = rollout.advantages_N(ALGORITHMS[c.algorithm.name], reward_weights(c),
                                        scale_rewards=c.algorithm.scale_rewards,
                                        whiten_advantages=c.algorithm.whiten_advantages)
    batch = rollout.to_batch(advantages_N, c.rollout.max_prompt_tokens)
    signal_N = np.repeat(signal_P, rollout.group_size)
    ahead = None
    if prefetcher is not None:
        position = run.stream.state()
        upcoming = prefetch(run, prefetcher, step + 1) if step + 1 < c.train.steps else None
        saving = run.checkpointer.due(step + 1, force=step + 1 == c.train.steps)
        ahead = Ahead(upcoming, position, snapshot(state.params) if saving else None)
    train_start = time.perf_counter()
    state, updates = update(run, state, step, batch, signal_N)
    wait_start = time.perf_counter()
    if ahead is not None:  # all of the next round comes from this version: the push waits for it
        Prefetcher.wait(ahead.pending)
    push_start = time.perf_counter()
    publish_weights(run.publisher, run.client, state.params, step + 1, frozen=state.frozen, pusher=run.pusher)
    now = time.perf_counter()
    seconds = {"train": wait_start - train_start, "wait": push_start - wait_start, "push": now - push_start,
               "step": now - started}
    row = step_metrics(c, step + 1, rollout, batch, counters, updates, seconds)
    row.update(sampling, data_position=run.stream.state(), service_restarts=run.client.service_restarts,
               peak_rss_gb=peak_rss_gb())
    if run.log.enabled and c.run.sample_every and (step + 1) % c.run.sample_every == 0:
        run.log.samples(sample_rows(c, run.tokenizer, step + 1, rollout))
    return state, row, ahead


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
        prefetcher = stack.enter_context(Prefetcher()) if c.rollout.async_ else None
        pending = prime(run, state, prefetcher) if prefetcher is not None and run.start_step < c.train.steps else None
        for step in range(run.start_step, c.train.steps):
            state, row, ahead = train_one_step(run, state, step, prefetcher, pending)
            run.log.metrics(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                            tok_s=f"{row['tokens_per_second']:.0f}", refresh=False)
            if (step + 1) % c.run.log_every == 0:
                bar.write(f"step {step + 1}/{c.train.steps} reward {row['reward_mean']:.3f} "
                          f"accuracy {row['accuracy']:.3f} loss {row['loss']:.4g} kl {row['kl']:.3g} "
                          f"length {row['response_length_mean']:.1f} {row['tokens_per_second']:.0f} tok/s")
            if c.train.eval_every and ((step + 1) % c.train.eval_every == 0 or step + 1 == c.train.steps):
                if (eval_row := periodic_eval(run, step + 1)) is not None:
                    run.log.metrics(eval_row)
                    last_eval = eval_row
                    bar.write(f"step {step + 1} eval " + eval_summary(eval_row))
            host = {"step": step + 1, "data_position": run.stream.state() if ahead is None else ahead.data_position,
                    "weight_version": step + 1}
            saved = state.checkpointed() if ahead is None else (state.checkpointed(), ahead.behaviour_params)
            run.checkpointer.save(step + 1, saved, host, force=step + 1 == c.train.steps)
            if step + 1 < c.train.steps and run.checkpointer.preempted(step + 1):  # saved above, on every process
                bar.write(f"preempted: saved step {step + 1}; the same command resumes it")
                raise Preempted(step + 1)  # leaving the stack flushes the run log and stops the services
            pending = None if ahead is None else ahead.pending
            return_freed_memory()
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

