"""The trainer's host loop (`python -m drgrpo_jax.train --config PATH [section.key=value ...]`).

It reads top to bottom: config -> set-up (`drgrpo_jax.train.setup`) -> per step: rollout -> rewards ->
advantages -> update -> weight push -> checkpoint, each stage a call with typed inputs and outputs
(`ScoredRollout`, `Batch`, `TrainState`); the train state is returned by each step, never changed in place.
Every random choice derives from (run.seed, step), and the data position and weight version are checkpointed
with the train state, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import reward_weights
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import Preempted
from drgrpo_jax.evaluate.evaluation import EvalSettings, eval_metrics, eval_summary
from drgrpo_jax.host_memory import peak_rss_gb, return_freed_memory, returning_compile_memory
from drgrpo_jax.hosts import fail_together
from drgrpo_jax.seeds import eval_seed
from drgrpo_jax.train.metrics import step_metrics
from drgrpo_jax.train.progress import StepBar, closing_summary, eval_line, say
from drgrpo_jax.train.rollout_queue import check_fresh
from drgrpo_jax.train.setup import setup

if TYPE_CHECKING:
    from drgrpo_jax.actor.actor import Actor
    from drgrpo_jax.data.examples import Example
    from drgrpo_jax.step.train_step import TrainState
    from drgrpo_jax.train.learner import Learner
    from drgrpo_jax.train.recorder import Recorder
    from drgrpo_jax.train.rollout_queue import RolloutQueue
    from drgrpo_jax.train.run_log import RunLog

__all__ = ["train", "train_one_step"]


def train_one_step(config: Config, queue: RolloutQueue, learner: Learner, recorder: Recorder, state: TrainState,
                   step: int) -> tuple[TrainState, dict[str, Any]]:
    """Step `step` (0-based): rollout -> rewards -> advantages -> update -> weight push; (new state, metrics row).

    The queue hands over the step's scored rollout (every process samples and scores its share of the prompts and
    the hosts gather the rows in prompt order; with rollout.async it was sampled K steps ahead), the learner
    runs ppo_epochs x minibatches_per_rollout jitted updates, and the queue pushes the new weights to every service.
    """
    c = config
    started = time.perf_counter()
    taken = queue.take(step)
    rollout = taken.rollout
    check_fresh(rollout.weight_versions, step, c.rollout.max_staleness)  # never trains on a rollout older than allowed
    advantages_N = rollout.advantages_N(ALGORITHMS[c.algorithm.name], reward_weights(c),
                                        scale_rewards=c.algorithm.scale_rewards,
                                        whiten_advantages=c.algorithm.whiten_advantages)
    batch = rollout.to_batch(advantages_N, c.rollout.max_prompt_tokens)
    queue.sample_ahead(state, step)
    train_start = time.perf_counter()
    state, updates = learner.update(state, step, batch, np.repeat(taken.signal_P, rollout.group_size))
    train_seconds = time.perf_counter() - train_start
    wait_seconds, push_seconds = queue.push(state, step + 1)
    now = time.perf_counter()
    seconds = {"train": train_seconds, "wait": wait_seconds, "push": push_seconds, "step": now - started}
    row = step_metrics(c, step + 1, rollout, batch, taken.counters, updates, seconds)
    row.update(taken.metrics, **queue.metrics(started, now, taken, wait_seconds), peak_rss_gb=peak_rss_gb())
    recorder.samples(step + 1, rollout)
    return state, row


def periodic_eval(config: Config, actor: Actor, held_out: tuple[Example, ...], step: int) -> dict[str, Any] | None:
    """Greedy accuracy, avg@k and pass@k on the held-out split after `step` steps: process 0 evaluates (None elsewhere).

    The other processes wait for it (and raise with it if it fails), so none runs ahead into the
    next step's collectives.
    """
    row = None
    with fail_together(f"evaluation after step {step}"):
        if jax.process_index() == 0 and held_out:
            c, start = config, time.perf_counter()
            settings = EvalSettings(max_new_tokens=c.rollout.max_new_tokens, samples=c.train.eval_samples,
                                    temperature=c.train.eval_temperature, seed=eval_seed(c.run.seed, step),
                                    chunk_prompts=len(held_out))
            prompts = actor.prompt_ids(held_out, c.data, c.rollout.max_prompt_tokens)
            row = {"step": step, **eval_metrics(actor, held_out, prompts, settings, expected_version=step),
                   "eval_seconds": time.perf_counter() - start}
    return row


# ---------------------------------------------------------------------------------------------
# The loop and the command line
# ---------------------------------------------------------------------------------------------


def train(config: Config, command: str = "") -> str:
    """Runs (or resumes) the configured training; returns the run directory. `command`: the command line that
    started it, for the model card of run.push_to_hub.

    It holds config.yaml (resolved), metrics.jsonl (one row per step; eval rows carry `eval/*` keys instead of
    `loss`), samples.jsonl, tensorboard/, checkpoints/, weights/, serve.log and final/ (an HF folder of the last
    policy; with LoRA a PEFT adapter folder).
    """
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(returning_compile_memory())
        (actor, learner, queue, recorder, held_out), state = setup(config, stack)
        c, log, steps = config, recorder.log, config.train.steps
        say(f"model.compute_dtype: {recorder.compute_dtype} (GEMMs of the train step and the local service)")
        last_eval = None  # the model card's evaluation table
        if c.train.eval_every and recorder.start_step == 0:
            last_eval = _evaluate(c, actor, held_out, 0, log, legend=True)
        return_freed_memory()  # what loading and dequantising the weights freed
        if recorder.start_step < steps:
            queue.prime(state, recorder.start_step)
            say(f"step {recorder.start_step + 1} compiles the training step, so it takes longer than the rest")
        bar = stack.enter_context(StepBar(steps, recorder.start_step))
        for step in range(recorder.start_step, steps):
            state, row = train_one_step(c, queue, learner, recorder, state, step)
            log.metrics(row)
            bar.step_done(row)
            if (step + 1) % c.run.log_every == 0:
                say(f"step {step + 1}/{steps} reward {row['reward_mean']:.3f} accuracy {row['accuracy']:.3f} "
                    f"loss {row['loss']:.4g} kl {row['kl']:.3g} length {row['response_length_mean']:.1f} "
                    f"{row['tokens_per_second']:.0f} tok/s")
            if c.train.eval_every and ((step + 1) % c.train.eval_every == 0 or step + 1 == steps):
                queue.drain()  # evaluation samples alone, from the version just pushed
                last_eval = _evaluate(c, actor, held_out, step + 1, log, legend=last_eval is None) or last_eval
            recorder.save(state, step + 1, queue)
            if step + 1 < steps and recorder.checkpointer.preempted(step + 1):  # saved above, on every process
                say(f"preempted: saved step {step + 1}; the same command resumes it")
                raise Preempted(step + 1)  # leaving the stack flushes the run log and stops the services
            return_freed_memory()
        queue.drain()  # the last deferred push is done (or its error raised) before the run ends
        bar.close()
        for line in recorder.export(state, last_eval, command):
            say(line)
        recorder.checkpointer.wait()
        summary = closing_summary(c.run.output_dir, steps, time.perf_counter() - started,
                                  recorder.checkpointer.all_steps(), tensorboard="tensorboard" in c.run.report_to,
                                  last_eval=eval_summary(last_eval) if last_eval else None)
        for line in summary:
            say(line)
    return c.run.output_dir


def _evaluate(config: Config, actor: Actor, held_out: tuple[Example, ...], step: int, log: RunLog, *,
              legend: bool) -> dict[str, Any] | None:
    """The periodic evaluation, logged and told (process 0: its row; elsewhere None)."""
    if held_out:
        say(f"evaluating after step {step} on {len(held_out)} held-out problems ...")
    row = periodic_eval(config, actor, held_out, step)
    if row is not None:
        log.metrics(row)
        say(eval_line(row, eval_summary(row), legend=legend))
    return row
