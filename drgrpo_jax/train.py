"""The trainer: `python -m drgrpo_jax.train --config PATH [section.key=value ...]` and its host loop.

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
serve.log, final/ (HF folder of the last policy). Throughput in metrics: tokens_per_second =
generated tokens / whole step time; rollout_tokens_per_second = generated tokens / rollout
time; train_tokens_per_second = (prompt + response) tokens x ppo_epochs / train time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

from drgrpo_jax.config import (Config, ConfigError, check_paths, component_names, config_from_argv, dump_config,
                               resolve_model_path)
from drgrpo_jax.data import Example, PromptDataset, PromptStream, tokenize_prompt
from drgrpo_jax.hosts import fail_together, gather_hosts
from drgrpo_jax.outputs import RunLog, WeightPublisher, host_array
from drgrpo_jax.rollout_batch import (advantages_N, correct_mask, host_share, left_pad, merge_host_rows, response_stats,
                                      step_seed, window_advantages)

__all__ = ["main", "train"]

PROG = "python -m drgrpo_jax.train"
_TIMING_KEYS = ("seconds", "per_second")  # metric names holding wall-clock figures (not reproducible)


# ---------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------


def _mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per-key mean of the updates' metrics."""
    return {key: float(np.mean([row[key] for row in rows])) for key in rows[0]}


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------


def load_tokenizer(model_path: str, tokenizer_path: str | None) -> Any:
    """The HF tokenizer of an HF folder, of a .gguf file (read without torch), or of tokenizer_path."""
    from transformers import AutoTokenizer

    key = "model.tokenizer_path" if tokenizer_path else "model.path"
    try:
        if tokenizer_path:
            return AutoTokenizer.from_pretrained(tokenizer_path)
        if model_path.endswith(".gguf"):
            from drgrpo_jax.models.gguf_io import load_gguf_tokenizer

            return load_gguf_tokenizer(model_path)
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as error:  # OSError, ValueError, missing files: the message names the key
        raise ConfigError(key, f"cannot load a tokenizer: {type(error).__name__}: {error}") from None


def build_mesh(config: Config) -> Any:
    """The (data, fsdp, tensor) mesh: the first data*fsdp*tensor devices (all of them on several hosts)."""
    import jax

    from drgrpo_jax.sharding import MeshShape, make_mesh

    m = config.mesh
    ways, devices = m.data * m.fsdp * m.tensor, jax.devices()
    if ways > len(devices) or (jax.process_count() > 1 and ways != len(devices)):
        raise ConfigError("mesh.data", f"mesh.data * mesh.fsdp * mesh.tensor = {ways}, but the run has "
                                       f"{len(devices)} devices")
    return make_mesh(MeshShape(data=m.data, fsdp=m.fsdp, tensor=m.tensor), devices[:ways])


def step_configs(config: Config) -> tuple[Any, Any]:
    """(train StepConfig, StepConfig for the old log-probs of a whole rollout); ConfigError when invalid."""
    from drgrpo_jax.algorithms import ALGORITHMS
    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.train_step import StepConfig

    a = config.algorithm
    try:
        loss = LossConfig(aggregation=ALGORITHMS[a.name].aggregation, budget=config.rollout.max_new_tokens,
                          clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, kl_coef=a.kl_coef,
                          kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef)
        train = StepConfig(loss=loss, micro_batches=config.train.micro_batches,
                           temperature=config.rollout.temperature, tis_cap=a.tis_cap)
    except (TypeError, ValueError) as error:
        key, _, reason = str(error).partition(": ")
        raise ConfigError(key.replace("LossConfig.", "algorithm."), reason) from None
    # The old log-probs run over the whole rollout: as many slices as all its updates' micro-batches.
    logprob = dataclasses.replace(train, micro_batches=config.train.micro_batches * a.minibatches_per_rollout)
    return train, logprob


def connect_urls(config: Config) -> Any:
    """A client for the configured services; ConfigError naming rollout.urls when one does not answer."""
    from drgrpo_jax.rollout import RolloutClient

    client = RolloutClient(config.rollout.urls, timeout_s=config.rollout.timeout_s)
    for url, ok in zip(client.urls, client.healthy()):
        if not ok:
            client.close()
            raise ConfigError("rollout.urls", f"{url} does not answer GET /health (is the generation service up?)")
    return client


def service_batch_size(config: Config) -> int:
    """--max-batch-size of the local child service: rollout.service_batch_size, else a whole rollout (or eval)."""
    r = config.rollout
    return r.service_batch_size or max(r.prompts_per_step * r.group_size, config.data.eval_size)


def publish_weights(publisher: WeightPublisher, client: Any, params: Any, version: int) -> str:
    """Exports version `version` (process 0 writes) and, given a client, pushes it to every URL (process 0).

    Every process waits for it and raises with it if it fails anywhere, so no host samples before the
    services hold the new weights.
    """
    import jax

    with fail_together(f"publishing weight version {version}"):
        path = publisher.publish(params, version)  # every process joins its gather
        if client is not None and jax.process_index() == 0:
            client.update_weights(path, version)
    return path


@dataclasses.dataclass
class Run:
    """What the host loop holds; built once by `setup`."""

    config: Config
    dataset: PromptDataset
    tokenizer: Any
    mesh: Any
    graphdef: Any
    state: Any
    train_fn: Any
    logprob_fn: Any
    checkpointer: Any
    publisher: WeightPublisher
    log: RunLog
    stream: PromptStream
    start_step: int
    client: Any = None  # every process: its rollouts and (process 0) the weight pushes
    scorer: Any = None  # every process scores its own share
    server: Any = None  # the local child service, when started (one process, no rollout.urls)


def _initialize_distributed(config: Config) -> None:
    """jax.distributed.initialize when mesh.coordinator_address is set (before any device is touched)."""
    m = config.mesh
    if m.coordinator_address:
        import jax

        jax.distributed.initialize(m.coordinator_address, num_processes=m.num_processes, process_id=m.process_id)


def setup(config: Config, stack: contextlib.ExitStack) -> Run:
    """Checks paths and services, loads data, tokenizer and model, restores a checkpoint, starts the service."""
    _initialize_distributed(config)
    import jax

    from drgrpo_jax.checkpoint import Checkpointer
    from drgrpo_jax.data import load_dataset
    from drgrpo_jax.models import from_pretrained
    from drgrpo_jax.rewards import RewardScorer
    from drgrpo_jax.rollout import LocalServer, RolloutClient
    from drgrpo_jax.sharding import param_shardings
    from drgrpo_jax.train_step import (init_state, jit_policy_logprobs, jit_train_step, make_optimizer, place,
                                       state_shardings)

    c, main_process = config, jax.process_index() == 0
    if jax.process_count() > 1 and not c.rollout.urls:
        raise ConfigError("rollout.urls", f"must list the generation services on {jax.process_count()} processes")
    check_paths(c)
    model_path = resolve_model_path(c.model.path)
    train_config, logprob_config = step_configs(c)
    dataset = load_dataset(c.data, c.run.seed)
    client = None
    if c.rollout.urls:  # every host checks that it reaches every service; all fail together if one does not
        with fail_together("reaching rollout.urls"):
            client = connect_urls(c)
        stack.callback(client.close)
    tokenizer = load_tokenizer(model_path, c.model.tokenizer_path)
    out = c.run.output_dir
    os.makedirs(os.path.join(out, "weights"), exist_ok=True)
    checkpointer = stack.enter_context(Checkpointer(os.path.join(out, "checkpoints"), save_every=c.train.save_every,
                                                    keep=c.train.keep_checkpoints))
    resume = checkpointer.should_resume(c.train.resume)
    scorer = stack.enter_context(RewardScorer(c.reward))

    mesh = build_mesh(c)
    dtype = {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}[c.model.dtype]
    model = from_pretrained(model_path, dtype=dtype, mesh=mesh, remat=c.model.remat)
    a = c.algorithm
    updates_per_step = a.ppo_epochs * a.minibatches_per_rollout
    o = c.optimizer
    optimizer, schedule = make_optimizer(o.learning_rate, total_steps=c.train.steps * updates_per_step,
                                         warmup_steps=o.warmup_steps, decay=o.decay, weight_decay=o.weight_decay,
                                         b1=o.b1, b2=o.b2, eps=o.eps, max_grad_norm=o.max_grad_norm or None)
    graphdef, state = init_state(model, optimizer, jax.random.key(c.run.seed), with_reference=a.kl_coef > 0)
    del model
    params_shardings = param_shardings(state.params, mesh)
    shardings = state_shardings(state, params_shardings, mesh)
    state = place(state, shardings)  # works across processes, where device_put cannot
    start_step, position = 0, 0
    if resume:
        restored = checkpointer.restore_latest(state)  # each leaf keeps the sharding place gave it
        state, start_step, position = restored.state, int(restored.host["step"]), int(restored.host["data_position"])
    if main_process:
        with open(os.path.join(out, "config.yaml"), "w") as f:
            f.write(dump_config(c))
    log = RunLog(out, start_step, main_process)
    stack.callback(log.close)
    publisher = WeightPublisher(os.path.join(out, "weights"), graphdef, mirror=c.run.weights_dir)
    publish_weights(publisher, client, state.params, start_step)
    server = None
    if client is None:  # one process (checked above): its own child service
        server = stack.enter_context(LocalServer(
            publisher.local_path(start_step), dtype=c.model.dtype, weight_version=start_step,
            log_path=os.path.join(out, "serve.log"), extra_args=["--max-batch-size", str(service_batch_size(c))]))
        client = stack.enter_context(RolloutClient([server.url], timeout_s=c.rollout.timeout_s))
    return Run(c, dataset, tokenizer, mesh, graphdef, state,
               jit_train_step(graphdef, optimizer, schedule, train_config, shardings, mesh),
               jit_policy_logprobs(graphdef, logprob_config, params_shardings, mesh),
               checkpointer, publisher, log, PromptStream(dataset, c.rollout.prompts_per_step, c.run.seed, position),
               start_step, client, scorer, server)


# ---------------------------------------------------------------------------------------------
# One step
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


def _sample_share(run: Run, step: int, prompts: list[list[int]], examples: tuple[Example, ...], seed: int,
                  offset: int) -> tuple[dict[str, np.ndarray], Any]:
    """This process's share: its rollout from the service(s) and its rewards, as per-row arrays (and the result)."""
    import jax

    r = run.config.rollout
    start = time.perf_counter()
    rollout = run.client.generate(prompts, r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                  top_p=r.top_p, top_k=r.top_k, stop_token_ids=_stop_ids(run), seed=seed,
                                  expected_version=step, max_staleness=r.max_staleness, prompt_offset=offset,
                                  first_url=jax.process_index())
    rollout_seconds = time.perf_counter() - start
    texts = run.tokenizer.batch_decode([ids[:n] for ids, n in zip(rollout.output_ids, rollout.lengths)],
                                       skip_special_tokens=True)
    start = time.perf_counter()
    result = run.scorer.score(texts, [e for e in examples for _ in range(r.group_size)])
    arrays = {"output_ids": rollout.output_ids, "logprobs": rollout.logprobs, "mask": rollout.mask,
              "lengths": rollout.lengths, "truncated": rollout.truncated,
              "versions": np.asarray([int(v) for v in rollout.weight_versions], np.int64),
              "components": result.components_NK,
              "seconds": np.asarray([rollout_seconds, time.perf_counter() - start]),
              "timeouts_F": np.asarray(result.timeouts_F, np.int64), "errors_F": np.asarray(result.errors_F, np.int64)}
    return arrays, result


_HOST_REDUCTIONS = {"seconds": "max", "timeouts_F": "sum", "errors_F": "sum"}  # arrays that are not one per row
_NOT_PER_ROW = tuple(_HOST_REDUCTIONS)


def _sample(run: Run, step: int, prompts: list[list[int]], examples: tuple[Example, ...],
            seed: int) -> tuple[dict, Any]:
    """Each process samples and scores its share; every process gets all rows. Returns (arrays, RewardResult).

    A failure on any process (a reward that stops the run, a service that does not answer) is raised
    on every process together: the hosts all-gather a failure flag before the arrays, so no host
    waits in a collective forever. The RewardResult's counters are summed over the hosts; its
    error messages are this host's own.
    """
    import jax

    host, hosts = jax.process_index(), jax.process_count()
    start, stop = host_share(len(prompts), hosts, host)
    with fail_together(f"sampling or scoring step {step + 1}"):
        local, result = _sample_share(run, step, prompts[start:stop], examples[start:stop], seed, start)
    arrays = merge_host_rows(gather_hosts(local), _HOST_REDUCTIONS)
    if hosts > 1 and (step + 1) % run.config.run.log_every == 0:
        print(f"[process {host}/{hosts}] step {step + 1}: sampled and scored prompts {start}-{stop - 1} "
              f"({len(local['lengths'])} responses)", file=sys.stderr, flush=True)
    merged = dataclasses.replace(result, components_NK=arrays["components"], timeouts_F=arrays["timeouts_F"],
                                 errors_F=arrays["errors_F"])
    return arrays, merged


def _global_batch(arrays: dict[str, np.ndarray], mesh: Any) -> Any:
    """A Batch of global arrays split over the data-parallel axes (every process holds all rows)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from drgrpo_jax.train_step import BATCH_AXES, Batch

    rows = NamedSharding(mesh, P(BATCH_AXES))
    return Batch(**{name: jax.make_array_from_callback(value.shape, rows, lambda index, v=value: v[index])
                    for name, value in arrays.items()})


def _update(run: Run, step: int, batch: dict[str, np.ndarray],
            signal_N: np.ndarray) -> tuple[list[dict[str, float]], list[tuple[float, float]]]:
    """Old log-probs, then ppo_epochs x minibatches_per_rollout updates: (each update's metrics, whitening stats).

    For gdpo each minibatch (one optimizer window) is whitened on its own rows.
    """
    import jax

    from drgrpo_jax.algorithms import ALGORITHMS

    a = run.config.algorithm
    batch["old_logprobs"] = host_array(run.logprob_fn(run.state.params, _global_batch(batch, run.mesh)))
    num = batch["row_valid"].shape[0]
    size = num // a.minibatches_per_rollout
    history, whitening = [], []
    for epoch in range(a.ppo_epochs):
        order = np.random.default_rng(step_seed(run.config.run.seed, step, 1 + epoch)).permutation(num)
        for m in range(a.minibatches_per_rollout):
            rows = order[m * size:(m + 1) * size]
            window = {k: v[rows] for k, v in batch.items()}
            if ALGORITHMS[a.name].multi_reward:
                window["advantages"], mean, std = window_advantages(window["advantages"], window["row_valid"],
                                                                    signal_N[rows])
                whitening.append((mean, std))
            run.state, metrics = run.train_fn(run.state, _global_batch(window, run.mesh))
            history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return history, whitening


def _sample_rows(run: Run, step: int, examples, result, arrays) -> list[dict[str, Any]]:
    """samples.jsonl rows: every completion of the step's first two prompts (decoded here: any host sampled them)."""
    rows, group = [], run.config.rollout.group_size
    total = result.total_N()
    for p, example in enumerate(examples[:2]):
        picked = range(p * group, (p + 1) * group)
        texts = run.tokenizer.batch_decode([arrays["output_ids"][i][:arrays["lengths"][i]] for i in picked],
                                           skip_special_tokens=True)
        for i, text in zip(picked, texts):
            rows.append({"step": step, "prompt_id": example.prompt_id, "question": example.question,
                         "answer": example.answer, "completion": text, "reward": float(total[i]),
                         **{f"reward/{n}": float(result.components_NK[i, k]) for k, n in enumerate(result.names)},
                         "length": int(arrays["lengths"][i]), "truncated": bool(arrays["truncated"][i])})
    return rows


_RESAMPLE_PURPOSE = 1000  # step_seed purposes 1000 + r: dynamic sampling's extra rollouts (1 + epoch: minibatch order)


def _reward_weights(config: Config) -> tuple[float, ...]:
    return tuple(config.reward.weights) or (1.0,) * len(component_names(config.reward))


def _select_groups(rounds: list[tuple], chosen: list[int], group: int) -> tuple[tuple, list, dict, Any]:
    """The chosen groups (indices over every round, in order) as one rollout: (examples, prompts, arrays, result)."""
    rows = (np.asarray(chosen, np.int64)[:, None] * group + np.arange(group)).reshape(-1)
    examples = tuple(e for rd in rounds for e in rd[0])
    prompts = [p for rd in rounds for p in rd[1]]
    arrays = {k: np.concatenate([rd[2][k] for rd in rounds])[rows] for k in rounds[0][2] if k not in _NOT_PER_ROW}
    for key in _NOT_PER_ROW:  # wall-clock and failure counters add up over the rounds
        arrays[key] = np.sum([rd[2][key] for rd in rounds], axis=0)
    results = [rd[3] for rd in rounds]
    result = dataclasses.replace(results[0], components_NK=arrays["components"], timeouts_F=arrays["timeouts_F"],
                                 errors_F=arrays["errors_F"],
                                 error_messages=tuple(m for res in results for m in res.error_messages)[:5])
    return tuple(examples[g] for g in chosen), [prompts[g] for g in chosen], arrays, result


def _rollout(run: Run, step: int) -> tuple[tuple, list, dict, Any, np.ndarray, dict[str, Any]]:
    """The step's P groups: (examples, prompt ids, arrays, RewardResult, valid_P, sampling metrics).

    With rollout.dynamic_sampling, groups without a learning signal (the algorithm's own test,
    `algorithms.group_signal`) are dropped and up to rollout.max_resample_rounds more rollouts
    of P prompts are drawn until P groups have one; a batch still short is filled with dropped
    groups marked as padding (row_valid False: no loss, no whitening statistics), so the step
    keeps its static shapes. Every process takes the same decisions from the shared rewards.
    """
    c, r = run.config, run.config.rollout
    rounds: list[tuple] = []
    with_signal = 0
    while True:
        examples = next(run.stream)
        prompts = _prompt_ids(run, examples)
        seed = step_seed(c.run.seed, step, _RESAMPLE_PURPOSE + len(rounds) if rounds else 0)
        arrays, result = _sample(run, step, prompts, examples, seed)
        _, signal_P = advantages_N(c, _reward_weights(c), arrays["components"], np.ones(len(prompts), bool))
        rounds.append((examples, prompts, arrays, result, signal_P))
        with_signal += int(signal_P.sum())
        if not r.dynamic_sampling or with_signal >= r.prompts_per_step or len(rounds) > r.max_resample_rounds:
            break
    signal_all = np.concatenate([rd[4] for rd in rounds])
    metrics: dict[str, Any] = {"zero_signal_fraction": float(1.0 - signal_all.mean())}
    if not r.dynamic_sampling:
        return examples, prompts, arrays, result, np.ones(len(prompts), bool), metrics
    keep = np.flatnonzero(signal_all)[:r.prompts_per_step].tolist()
    fill = np.flatnonzero(~signal_all)[:r.prompts_per_step - len(keep)].tolist()
    metrics.update({"sampling_rounds": len(rounds), "groups_drawn": len(signal_all),
                    "groups_dropped": int((~signal_all).sum()), "groups_padded": len(fill),
                    "groups_surplus": int(signal_all.sum()) - len(keep)})
    valid_P = np.asarray([True] * len(keep) + [False] * len(fill))
    return (*_select_groups(rounds, keep + fill, r.group_size), valid_P, metrics)


def train_one_step(run: Run, step: int) -> dict[str, Any]:
    """Rollout, rewards, advantages, updates and the weight push of step `step` (0-based); its metrics row."""
    c = run.config
    started = time.perf_counter()
    examples, prompts, arrays, result, valid_P, sampling = _rollout(run, step)
    names = component_names(c.reward)
    weights = _reward_weights(c)
    advantages, signal_P = advantages_N(c, weights, arrays["components"], valid_P)
    valid = np.repeat(valid_P, c.rollout.group_size)
    prompt_ids, prompt_mask = left_pad(prompts, c.rollout.max_prompt_tokens, c.rollout.group_size)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": arrays["output_ids"],
             "response_mask": arrays["mask"], "advantages": advantages,
             "old_logprobs": np.zeros_like(arrays["logprobs"]), "behaviour_logprobs": arrays["logprobs"],
             "row_valid": valid}
    train_start = time.perf_counter()
    history, whitening = _update(run, step, batch, np.repeat(signal_P, c.rollout.group_size))
    train_seconds = time.perf_counter() - train_start
    push_start = time.perf_counter()
    publish_weights(run.publisher, run.client, run.state.params, step + 1)
    push_seconds = time.perf_counter() - push_start
    step_seconds = time.perf_counter() - started

    components = arrays["components"][valid]  # the trained responses (padding groups left out)
    correct = correct_mask(names, components)
    generated = int(arrays["lengths"].sum())
    trained = int(prompt_mask[valid].sum() + arrays["mask"][valid].sum()) * c.algorithm.ppo_epochs
    total = components @ np.asarray(weights, np.float32)
    row: dict[str, Any] = {"step": step + 1, **_mean_metrics(history), "grad_norm_max": max(h["grad_norm"] for h in history),
                           "reward_mean": float(total.mean()), "reward_std": float(total.std()),
                           **response_stats(arrays["lengths"][valid], arrays["truncated"][valid], correct),
                           "advantage_abs_mean": float(np.abs(advantages[valid]).mean()),
                           **sampling,
                           "weight_version": int(arrays["versions"].min()),
                           "staleness": int(step - arrays["versions"].min()),
                           "data_position": run.stream.state(),
                           "tokens_per_second": generated / step_seconds,
                           "rollout_tokens_per_second": generated / max(arrays["seconds"][0], 1e-9),
                           "train_tokens_per_second": trained / train_seconds,
                           "rollout_seconds": float(arrays["seconds"][0]), "reward_seconds": float(arrays["seconds"][1]),
                           "train_seconds": train_seconds, "push_seconds": push_seconds, "step_seconds": step_seconds}
    if whitening:  # gdpo: the batch whitening statistics, averaged over the step's windows
        row["whiten_mean"] = float(np.mean([m for m, _ in whitening]))
        row["whiten_std"] = float(np.mean([sd for _, sd in whitening]))
    for k, name in enumerate(names):
        row[f"reward/{name}"] = float(components[:, k].mean())
    row.update({k: v for k, v in result.metrics().items() if k not in row})
    if run.log.enabled and c.run.sample_every and (step + 1) % c.run.sample_every == 0:
        run.log.samples(_sample_rows(run, step + 1, examples, result, arrays))
    return row


def evaluate(run: Run, step: int) -> dict[str, Any] | None:
    """Greedy accuracy on the held-out split after `step` steps: process 0 evaluates (None elsewhere).

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
    """evaluate's work on process 0."""
    c = run.config
    start = time.perf_counter()
    examples = run.dataset.eval
    rollout = run.client.generate(_prompt_ids(run, examples), 1, max_new_tokens=c.rollout.max_new_tokens,
                                  temperature=0.0, stop_token_ids=_stop_ids(run), seed=0, expected_version=step)
    texts = run.tokenizer.batch_decode([ids[:n] for ids, n in zip(rollout.output_ids, rollout.lengths)],
                                       skip_special_tokens=True)
    result = run.scorer.score(texts, list(examples))
    stats = response_stats(rollout.lengths, rollout.truncated, correct_mask(result.names, result.components_NK))
    row = {"step": step, **{f"eval/{k}": v for k, v in stats.items()}, "eval/reward_mean": float(result.total_N().mean()),
           "eval/num_prompts": len(examples), "eval_seconds": time.perf_counter() - start}
    return row


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
        run = setup(config, stack)
        c = run.config
        bar = stack.enter_context(_progress(run))
        if c.train.eval_every and run.start_step == 0:
            if (row := evaluate(run, 0)) is not None:
                run.log.metrics(row)
        for step in range(run.start_step, c.train.steps):
            row = train_one_step(run, step)
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
                    bar.write(f"step {step + 1} eval accuracy {eval_row['eval/accuracy']:.3f}")
            host = {"step": step + 1, "data_position": run.stream.state(), "weight_version": step + 1}
            run.checkpointer.save(step + 1, run.state, host, force=step + 1 == c.train.steps)
        final = os.path.join(c.run.output_dir, "final")
        run.publisher.export(run.state.params, final, tokenizer=run.tokenizer)
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
