"""The trainer: `python -m drgrpo_jax.train --config PATH [section.key=value ...]` and its host loop.

The loop reads top to bottom: config -> set-up (`drgrpo_jax.run.setup`: data, model, state,
services) -> per step: rollout -> rewards -> advantages -> update -> weight push -> checkpoint,
each stage a call with typed inputs and outputs (`ScoredRollout`, `Batch`, `TrainState`); the
train state is returned by each step, never changed in place.

One step: draw P prompts; every process samples G completions of its contiguous share of them
from the generation service(s) (a local child process unless rollout.urls is set; several hosts
need rollout.urls) and scores them, then the hosts all-gather the rows so each holds the whole
batch in prompt order; compute the algorithm's advantages;
recompute the policy's log-probs ("old"); run ppo_epochs x minibatches_per_rollout jitted
updates; export the new weights to run_dir/weights/v{step} (copied to run.weights_dir when set)
and point every service at them; log.
Every random choice derives from (run.seed, step), and the data position and weight version
are checkpointed with the train state, so a resumed run reproduces an uninterrupted one.

Run directory: config.yaml (resolved), metrics.jsonl (one row per step; eval rows carry
`eval/*` keys instead of `loss`), samples.jsonl, tensorboard/, checkpoints/, weights/,
serve.log, final/ (HF folder of the last policy; with LoRA a PEFT adapter folder). Throughput in
metrics: tokens_per_second = generated tokens / whole step time; rollout_tokens_per_second = generated tokens / rollout
time; train_tokens_per_second = (prompt + response) tokens x ppo_epochs / train time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np

from drgrpo_jax.config import Config, component_names, config_from_argv, one_window_per_rollout
from drgrpo_jax.data import Example, tokenize_prompt
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.evaluation import EvalSettings, eval_metrics, eval_summary
from drgrpo_jax.hosts import fail_together, gather_hosts
from drgrpo_jax.hub import push_folder
from drgrpo_jax.outputs import host_array
from drgrpo_jax.rollout_batch import (
    HostCounters,
    ScoredRollout,
    advantages_N,
    correct_mask,
    group_signal_P,
    host_share,
    merge_host_rows,
    response_stats,
    reward_weights,
    step_seed,
    window_advantages,
)
from drgrpo_jax.run import Run, publish_weights, setup

if TYPE_CHECKING:
    from drgrpo_jax.train_step import Batch, TrainState

__all__ = ["main", "train"]

PROG = "python -m drgrpo_jax.train"
_RESAMPLE_PURPOSE = 1000  # step_seed purposes 1000 + r: dynamic sampling's extra rollouts (1 + epoch: minibatch order)
_EVAL_PURPOSE = 999  # step_seed purpose of the evaluation's sampled completions


# ---------------------------------------------------------------------------------------------
# Rollout and rewards
# ---------------------------------------------------------------------------------------------


def _prompt_ids(run: Run, examples: tuple[Example, ...]) -> list[list[int]]:
    """Chat-templated prompt ids; a prompt over rollout.max_prompt_tokens is an error naming it."""
    limit = run.config.rollout.max_prompt_tokens
    prompts = [tokenize_prompt(example, run.config.data, run.tokenizer) for example in examples]
    for example, ids in zip(examples, prompts):
        if len(ids) > limit:
            raise ConfigError("rollout.max_prompt_tokens", f"prompt {example.prompt_id} has {len(ids)} tokens, "
                                                           f"over the limit {limit}")
    return prompts


def _stop_ids(run: Run) -> list[int]:
    eos = getattr(run.tokenizer, "eos_token_id", None)
    return [int(eos)] if eos is not None else []


def _version_number(version: str | None) -> int:
    """A completion's weight version as a number (generate has checked it against the expected step)."""
    if version is None:
        raise ValueError("weight_version: the generation service reported none for a completion")
    return int(version)


def _sample_share(run: Run, step: int, examples: tuple[Example, ...], prompts: list[list[int]], seed: int,
                  offset: int) -> tuple[ScoredRollout, HostCounters]:
    """This process's share of the prompts: sampled from the service(s) and scored here."""
    import jax

    r = run.config.rollout
    start = time.perf_counter()
    sampled = run.client.generate(prompts, r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                  top_p=r.top_p, top_k=r.top_k, stop_token_ids=[] if r.ignore_eos else _stop_ids(run),
                                  ignore_eos=r.ignore_eos, seed=seed,
                                  expected_version=step, max_staleness=r.max_staleness, prompt_offset=offset,
                                  first_url=jax.process_index())
    rollout_seconds = time.perf_counter() - start
    texts = run.tokenizer.batch_decode([ids[:n] for ids, n in zip(sampled.output_ids, sampled.lengths)],
                                       skip_special_tokens=True)
    start = time.perf_counter()
    scored = run.scorer.score(texts, [e for e in examples for _ in range(r.group_size)], sampled.lengths)
    counters = HostCounters(scored.functions, rollout_seconds, time.perf_counter() - start, scored.timeouts_F,
                            scored.errors_F, scored.error_messages)
    rows = {"response_ids": sampled.output_ids, "behaviour_logprobs": sampled.logprobs,
            "response_mask": sampled.mask, "lengths": sampled.lengths, "truncated": sampled.truncated,
            "versions": np.asarray([_version_number(v) for v in sampled.weight_versions], np.int64),
            "components": scored.components_NK}
    return ScoredRollout.from_rows(examples, prompts, rows), counters


def sample(run: Run, step: int, examples: tuple[Example, ...], prompts: list[list[int]],
           seed: int) -> tuple[ScoredRollout, HostCounters]:
    """Each process samples and scores its share; every process gets the whole rollout, in prompt order.

    A failure on any process (a reward that stops the run, a service that does not answer) is raised
    on every process together: the hosts all-gather a failure flag before the rows, so no host
    waits in a collective forever. Counters are the slowest host's times and the hosts' summed counts.
    """
    import jax

    host, hosts = jax.process_index(), jax.process_count()
    start, stop = host_share(len(prompts), hosts, host)
    with fail_together(f"sampling or scoring step {step + 1}"):
        share, counters = _sample_share(run, step, examples[start:stop], prompts[start:stop], seed, start)
    stacked_rows, stacked_counters = gather_hosts((share.rows(), counters.arrays()))
    if hosts > 1 and (step + 1) % run.config.run.log_every == 0:
        print(f"[process {host}/{hosts}] step {step + 1}: sampled and scored prompts {start}-{stop - 1} "
              f"({len(share.lengths)} responses)", file=sys.stderr, flush=True)
    rollout = ScoredRollout.from_rows(examples, prompts, merge_host_rows(stacked_rows))
    return rollout, counters.across_hosts(stacked_counters)


def collect_rollout(run: Run, step: int) -> tuple[ScoredRollout, np.ndarray, HostCounters, dict[str, Any]]:
    """The step's P scored groups, bool [P] which carry a learning signal, every round's counters, sampling metrics.

    With rollout.dynamic_sampling, groups without a learning signal (the algorithm's own test,
    `algorithms.group_signal`) are dropped and up to rollout.max_resample_rounds more rollouts
    of P prompts are drawn until P groups have one; a batch still short is filled with dropped
    groups marked as padding (group_valid False: no loss, no whitening statistics), so the step
    keeps its static shapes. Every process takes the same decisions from the shared rewards.
    """
    c, r = run.config, run.config.rollout
    rounds: list[ScoredRollout] = []
    counters: list[HostCounters] = []
    signals: list[np.ndarray] = []
    while True:
        examples = next(run.stream)
        seed = step_seed(c.run.seed, step, _RESAMPLE_PURPOSE + len(rounds) if rounds else 0)
        rollout, counted = sample(run, step, examples, _prompt_ids(run, examples), seed)
        rounds.append(rollout)
        counters.append(counted)
        signals.append(group_signal_P(c, rollout))
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


# ---------------------------------------------------------------------------------------------
# Update
# ---------------------------------------------------------------------------------------------


def _global_batch(batch: Batch, mesh: Any) -> Batch:
    """The host batch as global arrays split over the data-parallel axes (every process holds all rows)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from drgrpo_jax.train_step import BATCH_AXES

    rows = NamedSharding(mesh, P(BATCH_AXES))
    return jax.tree.map(lambda v: jax.make_array_from_callback(v.shape, rows, lambda index: v[index]), batch)


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """What the step's optimizer updates report."""

    metrics: list[dict[str, float]]  # one row per update (optimizer window)
    whitening: list[tuple[float, float]]  # gdpo: each window's (mean, std) of the combined advantages
    old_logprob_seconds: float = 0.0  # the old-logprob forward over the rollout (0: skipped, on-policy)


def update(run: Run, state: TrainState, step: int, batch: Batch,
           signal_N: np.ndarray) -> tuple[TrainState, UpdateResult]:
    """Old log-probs (when several windows share the rollout), then ppo_epochs x minibatches_per_rollout
    optimizer windows: (new state, their report).

    For gdpo each window is whitened on its own rows.
    """
    import jax

    from drgrpo_jax.algorithms import ALGORITHMS

    a = run.config.algorithm
    start = time.perf_counter()
    if not one_window_per_rollout(a):  # else the step uses its own forward's log-probs (StepConfig.on_policy)
        old_logprobs = host_array(run.logprob_fn(state.params, _global_batch(batch, run.mesh), state.frozen))
        batch = dataclasses.replace(batch, old_logprobs=old_logprobs)
    old_logprob_seconds = time.perf_counter() - start
    num = batch.row_valid.shape[0]
    size = num // a.minibatches_per_rollout
    history, whitening = [], []
    for epoch in range(a.ppo_epochs):
        order = np.random.default_rng(step_seed(run.config.run.seed, step, 1 + epoch)).permutation(num)
        for m in range(a.minibatches_per_rollout):
            rows = order[m * size:(m + 1) * size]
            window = jax.tree.map(lambda v, rows=rows: v[rows], batch)
            if ALGORITHMS[a.name].multi_reward:
                advantages, mean, std = window_advantages(window.advantages, window.row_valid, signal_N[rows])
                window = dataclasses.replace(window, advantages=advantages)
                whitening.append((mean, std))
            state, metrics = run.train_fn(state, _global_batch(window, run.mesh))
            history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return state, UpdateResult(history, whitening, old_logprob_seconds)


# ---------------------------------------------------------------------------------------------
# Metrics and samples
# ---------------------------------------------------------------------------------------------


def step_metrics(config: Config, step: int, rollout: ScoredRollout, batch: Batch, counters: HostCounters,
                 updates: UpdateResult, seconds: dict[str, float]) -> dict[str, Any]:
    """metrics.jsonl's row for step `step` (1-based): losses, rewards, lengths, staleness, throughput."""
    names, valid = component_names(config.reward), rollout.row_valid
    components = rollout.components[valid]  # the trained responses (padding groups left out)
    total = components @ np.asarray(reward_weights(config), np.float32)
    generated = int(rollout.lengths.sum())
    trained = int(batch.prompt_mask[valid].sum() + batch.response_mask[valid].sum()) * config.algorithm.ppo_epochs
    history = updates.metrics
    row: dict[str, Any] = {
        "step": step, **{key: float(np.mean([h[key] for h in history])) for key in history[0]},
        "grad_norm_max": max(h["grad_norm"] for h in history),
        "reward_mean": float(total.mean()), "reward_std": float(total.std()),
        **response_stats(rollout.lengths[valid], rollout.truncated[valid], correct_mask(names, components)),
        "advantage_abs_mean": float(np.abs(batch.advantages[valid]).mean()),
        "weight_version": int(rollout.versions.min()), "staleness": int(step - 1 - rollout.versions.min()),
        "tokens_per_second": generated / seconds["step"],
        "rollout_tokens_per_second": generated / max(counters.rollout_seconds, 1e-9),
        "train_tokens_per_second": trained / seconds["train"],
        "rollout_seconds": counters.rollout_seconds, "reward_seconds": counters.reward_seconds,
        "train_seconds": seconds["train"], "old_logprob_seconds": updates.old_logprob_seconds,
        "push_seconds": seconds["push"], "step_seconds": seconds["step"]}
    if updates.whitening:  # gdpo: the batch whitening statistics, averaged over the step's windows
        row["whiten_mean"] = float(np.mean([m for m, _ in updates.whitening]))
        row["whiten_std"] = float(np.mean([sd for _, sd in updates.whitening]))
    row.update({f"reward/{name}": float(components[:, k].mean()) for k, name in enumerate(names)})
    return row | counters.metrics()


def _sample_rows(run: Run, step: int, rollout: ScoredRollout) -> list[dict[str, Any]]:
    """samples.jsonl rows: every completion of the step's first two prompts (decoded here: any host sampled them)."""
    rows, group = [], rollout.group_size
    names = component_names(run.config.reward)
    total = rollout.components @ np.asarray(reward_weights(run.config), np.float32)
    for p, example in enumerate(rollout.examples[:2]):
        picked = range(p * group, (p + 1) * group)
        texts = run.tokenizer.batch_decode([rollout.response_ids[i][:rollout.lengths[i]] for i in picked],
                                           skip_special_tokens=True)
        for i, text in zip(picked, texts):
            rows.append({"step": step, "prompt_id": example.prompt_id, "question": example.question,
                         "answer": example.answer, "completion": text, "reward": float(total[i]),
                         **{f"reward/{n}": float(rollout.components[i, k]) for k, n in enumerate(names)},
                         "length": int(rollout.lengths[i]), "truncated": bool(rollout.truncated[i])})
    return rows


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------


def train_one_step(run: Run, state: TrainState, step: int) -> tuple[TrainState, dict[str, Any]]:
    """Step `step` (0-based): rollout -> rewards -> advantages -> update -> weight push; (new state, metrics row)."""
    c = run.config
    started = time.perf_counter()
    rollout, signal_P, counters, sampling = collect_rollout(run, step)
    batch = rollout.to_batch(advantages_N(c, rollout), c.rollout.max_prompt_tokens)
    signal_N = np.repeat(signal_P, rollout.group_size)
    train_start = time.perf_counter()
    state, updates = update(run, state, step, batch, signal_N)
    push_start = time.perf_counter()
    publish_weights(run.publisher, run.client, state.params, step + 1, frozen=state.frozen)
    now = time.perf_counter()
    seconds = {"train": push_start - train_start, "push": now - push_start, "step": now - started}
    row = step_metrics(c, step + 1, rollout, batch, counters, updates, seconds)
    row.update(sampling, data_position=run.stream.state(), service_restarts=run.client.service_restarts)
    if run.log.enabled and c.run.sample_every and (step + 1) % c.run.sample_every == 0:
        run.log.samples(_sample_rows(run, step + 1, rollout))
    return state, row


def evaluate(run: Run, step: int) -> dict[str, Any] | None:
    """Greedy accuracy, avg@k and pass@k on the held-out split after `step` steps: process 0 evaluates (None elsewhere).

    The other processes wait for it (and raise with it if it fails), so none runs ahead into the
    next step's collectives.
    """
    import jax

    row = None
    with fail_together(f"evaluation after step {step}"):
        if jax.process_index() == 0 and run.dataset.eval:
            row = _evaluate(run, step)
    return row


def _evaluate(run: Run, step: int) -> dict[str, Any]:
    """evaluate's work on process 0: greedy and train.eval_samples sampled completions (drgrpo_jax.evaluation)."""
    c = run.config
    start = time.perf_counter()
    settings = EvalSettings(max_new_tokens=c.rollout.max_new_tokens, samples=c.train.eval_samples,
                            temperature=c.train.eval_temperature, seed=step_seed(c.run.seed, step, _EVAL_PURPOSE),
                            chunk_prompts=max(len(run.dataset.eval), 1))
    row = eval_metrics(run.client, run.tokenizer, run.scorer, run.dataset.eval, _prompt_ids(run, run.dataset.eval),
                       settings, stop_token_ids=_stop_ids(run), expected_version=step)
    return {"step": step, **row, "eval_seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------
# The loop and the command line
# ---------------------------------------------------------------------------------------------


def _progress(run: Run) -> Any:
    """A tqdm bar on process 0 (a no-op object elsewhere)."""
    import jax
    from tqdm.auto import tqdm

    return tqdm(total=run.config.train.steps, initial=run.start_step, desc="train", unit="step", dynamic_ncols=True,
                disable=jax.process_index() != 0, file=sys.stderr)


def train(config: Config) -> str:
    """Runs (or resumes) the configured training; returns the run directory."""
    with contextlib.ExitStack() as stack:
        run, state = setup(config, stack)
        c = run.config
        bar = stack.enter_context(_progress(run))
        if run.log.enabled:  # process 0; beside the progress bar on stderr
            print(f"model.compute_dtype: {run.compute_dtype} (GEMMs of the train step and the local service)",
                  file=sys.stderr, flush=True)
        if c.train.eval_every and run.start_step == 0:
            if (row := evaluate(run, 0)) is not None:
                run.log.metrics(row)
        for step in range(run.start_step, c.train.steps):
            state, row = train_one_step(run, state, step)
            run.log.metrics(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                            tok_s=f"{row['tokens_per_second']:.0f}", refresh=False)
            if (step + 1) % c.run.log_every == 0:
                bar.write(f"step {step + 1}/{c.train.steps} reward {row['reward_mean']:.3f} "
                          f"accuracy {row['accuracy']:.3f} loss {row['loss']:.4g} kl {row['kl']:.3g} "
                          f"length {row['response_length_mean']:.1f} {row['tokens_per_second']:.0f} tok/s")
            if c.train.eval_every and ((step + 1) % c.train.eval_every == 0 or step + 1 == c.train.steps):
                if (eval_row := evaluate(run, step + 1)) is not None:
                    run.log.metrics(eval_row)
                    bar.write(f"step {step + 1} eval " + eval_summary(eval_row))
            host = {"step": step + 1, "data_position": run.stream.state(), "weight_version": step + 1}
            run.checkpointer.save(step + 1, state.checkpointed(), host, force=step + 1 == c.train.steps)
        final = os.path.join(c.run.output_dir, "final")
        run.publisher.export(state.params, final, tokenizer=run.tokenizer)  # with LoRA: the PEFT adapter
        if state.frozen is not None and c.model.lora.export_merged:
            run.publisher.export_merged(state.params, state.frozen, os.path.join(final, "merged"), run.tokenizer)
        if c.run.push_to_hub and run.log.enabled:
            bar.write(f"pushed {final} to the Hub: {push_folder(final, c.run.push_to_hub, private=c.run.hub_private)}")
        bar.write(f"done: {c.train.steps} steps; policy exported to {final}")
    return c.run.output_dir


def main(argv: list[str] | None = None) -> int:
    """The CLI: a bad config, path, task or URL exits 2 and a failed run exits 1, each with one line on stderr."""
    config = config_from_argv(argv, prog=PROG)  # exits 2 itself on a bad config
    try:
        train(config)
    except ConfigError as error:
        print(f"{PROG}: config error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; resume with the same command (train.resume=true)", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line here; the whole traceback goes to error.log
        log_path = os.path.join(config.run.output_dir, "error.log")
        with contextlib.suppress(OSError), open(log_path, "w") as f:
            traceback.print_exc(file=f)
        message = (str(error).strip().splitlines() or [""])[0][:500]  # e.g. a service's log tail stays in error.log
        print(f"{PROG}: {type(error).__name__}: {message} (traceback in {log_path})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
