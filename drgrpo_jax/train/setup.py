"""A training run's set-up: `setup(config)` checks paths and services, loads data, tokenizer and model,
restores the last checkpoint and starts the generation service, and returns the run's roles (what samples and
scores, what learns, the rollout queue, what records) with the train state it starts from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from drgrpo_jax.actor.actor import Actor
from drgrpo_jax.checkpoint import Checkpointer
from drgrpo_jax.config.api_keys import api_key
from drgrpo_jax.config.derived import (
    child_service_batch_size,
    lora_base_dtype,
    lora_spec,
    optimizer_of,
    step_configs,
)
from drgrpo_jax.config.load import check_paths, dump_config, resolve_model_path
from drgrpo_jax.config.rules import check_model_options
from drgrpo_jax.config.schema import Config
from drgrpo_jax.data.examples import Example
from drgrpo_jax.data.order import PromptStream
from drgrpo_jax.data.sources import load_dataset
from drgrpo_jax.environments.build import build_episodes
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hosts import fail_together, start_distributed
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.hf_io import load_hf_config
from drgrpo_jax.models.lora import add_adapters, store_base
from drgrpo_jax.models.precision import DTYPES, resolve_compute_dtype
from drgrpo_jax.models.pretrained import from_pretrained, load_tokenizer
from drgrpo_jax.plan.planner import auto_remat
from drgrpo_jax.rewards.scorer import RewardScorer
from drgrpo_jax.rollout.client import RolloutClient, RouterShape, model_vocab_size
from drgrpo_jax.rollout.local_service import LocalServer
from drgrpo_jax.rollout.weight_push import SegmentPusher, WeightPublisher, check_room, publish_weights, sync_mode
from drgrpo_jax.seeds import init_key, lora_init_key
from drgrpo_jax.sharding import MeshShape, make_mesh, param_shardings, parse_service_mesh, place, service_mesh
from drgrpo_jax.step.train_step import init_state, jit_policy_logprobs, jit_train_step, state_shardings
from drgrpo_jax.train.collect import RoundSource
from drgrpo_jax.train.hub import check_hub
from drgrpo_jax.train.learner import Learner
from drgrpo_jax.train.progress import phase, say
from drgrpo_jax.train.recorder import Recorder
from drgrpo_jax.train.rollout_queue import (
    QueueRecord,
    RolloutQueue,
    check_queue,
    held_rounds,
    in_flight,
    resumed_stream_position,
    rounds_in_flight,
    saved_params,
)
from drgrpo_jax.train.run_log import RunLog
from drgrpo_jax.train.trackers import check_trackers, open_trackers
from drgrpo_jax.weight_folders import absolute, is_remote, scratch_folder, write_text

if TYPE_CHECKING:
    from flax import nnx

    from drgrpo_jax.step.train_step import TrainState

__all__ = ["Roles", "setup"]


class Roles(NamedTuple):
    """A run's parts, each given to the functions that use it."""

    actor: Actor  # samples and scores: training rounds and evaluation alike
    learner: Learner  # the jitted update on the mesh
    queue: RolloutQueue  # which rounds each step trains on, and the weight pushes between them
    recorder: Recorder  # checkpoints, the run log, the final export
    held_out: tuple[Example, ...]  # the evaluation split (train.eval_every)


def build_mesh(config: Config) -> jax.sharding.Mesh:
    """The (data, fsdp, context, tensor) mesh in topology order: the first data*fsdp*tensor*context devices (all of
    them on several hosts); with mesh.dcn_data > 1, that many slices, mesh.data's outer ways crossing between them."""
    m = config.mesh
    ways, devices = m.data * m.fsdp * m.tensor * m.context, jax.devices()
    if ways > len(devices) or (jax.process_count() > 1 and ways != len(devices)):
        raise ConfigError("mesh.data", f"mesh.data * mesh.fsdp * mesh.tensor * mesh.context = {ways}, but the run "
                                       f"has {len(devices)} devices")
    try:
        return make_mesh(MeshShape(data=m.data, fsdp=m.fsdp, tensor=m.tensor, context=m.context), devices[:ways],
                         dcn_data=m.dcn_data)
    except ValueError as error:  # the slices do not match mesh.dcn_data
        raise ConfigError("mesh.dcn_data", str(error)) from None


_KERNEL_BACKENDS = {"cudnn": "gpu", "splash": "tpu"}  # attention kernels that run on one backend only


def check_service_mesh(config: Config) -> None:
    """ConfigError naming rollout.service_mesh when this host has fewer devices than the child service's mesh
    (checked before anything loads or compiles; the model's heads are checked by the child before it loads).
    Services of rollout.urls run elsewhere: their devices are not this host's."""
    if config.rollout.urls:
        return
    try:
        service_mesh(parse_service_mesh(config.rollout.service_mesh, "rollout.service_mesh"), "rollout.service_mesh")
    except ValueError as error:
        raise ConfigError("rollout.service_mesh", str(error).removeprefix("rollout.service_mesh: ")) from None


def check_attention_backend(impl: str, backend: str) -> None:
    """ConfigError unless model.attention_impl can run on `backend` (checked before anything compiles)."""
    needed = _KERNEL_BACKENDS.get(impl)
    if needed is not None and backend != needed:
        raise ConfigError("model.attention_impl", f"{impl} runs on {needed} devices only; this run's are {backend}")


def connect_urls(config: Config) -> RolloutClient:
    """A client for the configured services; ConfigError naming rollout.urls when one does not answer."""
    r = config.rollout
    client = RolloutClient(r.urls, timeout_s=r.timeout_s, api_key=api_key(r.api_key_env), engine=r.engine,
                           vocab_size=model_vocab_size(resolve_model_path(config.model.path)))
    for url, ok in zip(client.urls, client.healthy()):
        if not ok:
            client.close()
            raise ConfigError("rollout.urls", f"{url} does not answer GET /health (is the generation service up?)")
    try:
        client.check_engine()  # now, before anything is built: vLLM's start flags, whether SGLang honours seeds
        if config.rollout.inflight_updates:
            check_inflight(client)
    except BaseException:
        client.close()
        raise
    return client


def check_inflight(client: RolloutClient) -> None:
    """ConfigError naming rollout.inflight_updates for a service that does not say (/get_model_info) that it runs
    with --inflight-updates: its batches would sample on one version while the pushes skip the wait for them."""
    for i, url in enumerate(client.urls):
        if client.model_info(i).get("inflight_updates") is not True:
            raise ConfigError("rollout.inflight_updates", f"{url} does not run with --inflight-updates (start the "
                                                          "service with it, or set rollout.inflight_updates=false)")


def child_service_args(config: Config) -> list[str]:
    """The trainer's own child service's flags beyond its model and port. Its deadline is the client's, so the
    service never answers "abort" to a client still willing to wait; it admits every request of its one client
    (admission's estimate assumes each row runs to its budget, and would refuse rounds that finish in time)."""
    return ["--max-batch-size", str(child_service_batch_size(config)),
            "--request-timeout-s", str(config.rollout.timeout_s), "--admission-share", "0",
            *(["--inflight-updates"] if config.rollout.inflight_updates else []),
            *(["--prefix-cache-bytes", str(p)] if (p := config.rollout.service_prefix_cache_bytes) else [])]


def run_metadata(client: RolloutClient | None) -> dict[str, Any]:
    """What the trackers record beside the config: the services that ignore sampling seeds ({} when none does)."""
    ignored = () if client is None else client.seeds_ignored_by
    return {"rollout_seeds_honoured": False, "rollout_seeds_ignored_by": list(ignored)} if ignored else {}


def weights_roots(config: Config) -> list[str]:
    """The folders the trainer's own child service may load weight pushes from: this run's versions only."""
    roots = [os.path.abspath(os.path.join(scratch_folder(config.run.output_dir), "weights"))]
    if config.run.weights_dir:
        roots.append(absolute(config.run.weights_dir))
    return roots


def weights_mirror(config: Config) -> str | None:
    """Where each version is copied for the services: run.weights_dir; with run.output_dir on a bucket and services
    elsewhere (rollout.urls), output_dir/weights, since the versions the trainer writes are on its own disk."""
    out = config.run.output_dir
    if not config.run.weights_dir and is_remote(out) and config.rollout.urls:
        return os.path.join(out, "weights")
    return config.run.weights_dir


def setup(config: Config, stack: contextlib.ExitStack) -> tuple[Roles, TrainState]:
    """(the run's roles, the train state to start from): fresh, or the last checkpoint's when resuming."""
    m = config.mesh  # first, before any device is touched (importing a module touches none)
    start_distributed(m.coordinator_address, m.num_processes, m.process_id, m.coordinator_port)
    c, main_process = config, jax.process_index() == 0
    if jax.process_count() > 1 and not c.rollout.urls:
        raise ConfigError("rollout.urls", f"must list the generation services on {jax.process_count()} processes")
    if jax.process_count() > 1 and c.rollout.inflight_updates:
        raise ConfigError("rollout.inflight_updates", f"runs on one process only, this run has "
                                                      f"{jax.process_count()} (mesh.coordinator_address=auto)")
    check_paths(c)
    check_trackers(c)
    check_service_mesh(c)
    weight_sync = sync_mode(c, local_child=not c.rollout.urls)  # shm: the pushes to the child skip the disk
    check_hub(c.run.push_to_hub)
    model_path = resolve_model_path(c.model.path)
    if c.model.lora.rank and os.path.isdir(model_path):  # the architecture's own rules, before the model loads
        check_model_options(c, load_hf_config(model_path))
    stored_dtype = lora_base_dtype(c) if c.model.lora.rank else c.model.dtype  # bfloat16 base: bfloat16 GEMMs
    compute_dtype = resolve_compute_dtype(c.model.compute_dtype, stored_dtype, jax.devices()[0])
    train_config, logprob_config = step_configs(c, compute_dtype)
    with phase(f"loading the data ({c.data.source})"):
        dataset = load_dataset(c.data, c.run.seed)
    client = None
    if c.rollout.urls:  # every host checks that it reaches every service; all fail together if one does not
        with fail_together("reaching rollout.urls"):
            client = connect_urls(c)
        stack.callback(client.close)
    tokenizer = load_tokenizer(model_path, c.model.tokenizer_path)
    out, local_out = c.run.output_dir, scratch_folder(c.run.output_dir)  # the same folder unless out is a bucket
    os.makedirs(os.path.join(local_out, "weights"), exist_ok=True)
    checkpointer = stack.enter_context(Checkpointer(os.path.join(out, "checkpoints"), save_every=c.train.save_every,
                                                    keep=c.train.keep_checkpoints, catch_sigterm=True))
    resume, saved_optimizer = checkpointer.should_resume(c.train.resume), True
    if resume:  # before anything is built: a queue the run cannot restore must not be mistaken for a damaged save
        latest = checkpointer.latest_host_state()
        if latest is not None:
            latest_record = QueueRecord.from_host(latest)
            check_queue(latest_record, c.rollout.async_, c.rollout.max_staleness, c.rollout.inflight_updates)
            saved_optimizer = latest_record.optimizer_state
    scorer = stack.enter_context(RewardScorer(c.reward, budget=c.rollout.max_new_tokens))
    episodes = None
    if c.environment.enabled:  # before any compile: a tool or factory that cannot be built is a config error
        episodes = build_episodes(c, tokenizer)

    mesh = build_mesh(c)
    dtype = DTYPES[c.model.dtype]
    check_attention_backend(c.model.attention_impl, jax.default_backend())
    fixed_remat = "none" if c.model.remat == "auto" else c.model.remat
    with phase(f"loading the model {c.model.path}"):
        model = from_pretrained(model_path, dtype=dtype, mesh=mesh, remat=fixed_remat,
                                attention_impl=c.model.attention_impl)
    if c.model.remat == "auto":  # the plan's pick for this device's memory (python -m drgrpo_jax.plan shows it)
        model.runtime = dataclasses.replace(model.runtime, remat=auto_remat(c, model.config, jax.devices()[0]))
    if (spec := lora_spec(c)) is not None:  # adapters train, the base stays frozen (TrainState.frozen)
        model = add_adapters(model, spec, lora_init_key(c.run.seed))
        model = store_base(model, stored_dtype)  # deterministic: a resumed run rebuilds the same stored base
    optimizer, schedule = optimizer_of(c)
    graphdef, state = init_state(model, optimizer, init_key(c.run.seed), with_reference=c.algorithm.kl_coef > 0)
    model_config = model.config
    del model
    params_shardings = param_shardings(state.params, mesh)
    frozen_shardings = None if state.frozen is None else param_shardings(state.frozen, mesh)
    shardings = state_shardings(state, params_shardings, mesh, frozen_shardings)
    state = place(state, shardings)  # works across processes, where device_put cannot
    weight_sync = check_room(c, weight_sync, state.params, state.frozen)  # /dev/shm may be too small for two versions
    start_step, position, queued = 0, 0, None
    if resume:
        # Each leaf keeps the sharding place gave it; the frozen LoRA base is not in checkpoints (it is model.path).
        # rollout.async also saves the params that sample the queued rounds (drgrpo_jax.train.rollout_queue).
        # rollout.inflight_updates saves the queued rounds themselves instead (the checkpoint's `rounds`).
        k, saves_params = c.rollout.max_staleness, c.rollout.async_ and not c.rollout.inflight_updates
        saved = state.checkpointed(optimizer=saved_optimizer)
        target = (saved, saved_params([state.params] * k, k)) if saves_params else saved
        restored = checkpointer.restore_latest(target, rounds=c.rollout.inflight_updates)
        if restored is None:  # should_resume saw a checkpoint; none is left
            raise ConfigError("train.resume", f"no checkpoint left in {checkpointer.directory} to resume from")
        restored_state = restored.state[0] if saves_params else restored.state
        record = QueueRecord.from_host(restored.host)
        start_step, position = record.step, record.data_position
        say(f"resuming from the checkpoint of step {start_step} in {checkpointer.directory}")
        if not saved_optimizer:
            say("it holds no optimizer state (saved with train.checkpoint_optimizer=false): the optimizer's moments "
                "start afresh")
        state = dataclasses.replace(restored_state, frozen=state.frozen,
                                    opt_state=restored_state.opt_state if saved_optimizer else state.opt_state)
        if c.rollout.inflight_updates:
            queued = held_rounds(record, restored.rounds)
            position = queued.stream_position
        elif c.rollout.async_:
            queued = in_flight(record, restored.state[1], k)
            position = resumed_stream_position(queued, len(rounds_in_flight(start_step, k, c.train.steps)))
    if main_process:
        write_text(os.path.join(out, "config.yaml"), dump_config(c))
    trackers = open_trackers(c, out, start_step, run_metadata(client)) if main_process else []
    log = RunLog(out, start_step, main_process, trackers)
    stack.callback(log.close)
    # With LoRA each version is a PEFT adapter folder naming the base; a service given one loads that base.
    publisher = WeightPublisher(os.path.join(local_out, "weights"), graphdef, mirror=weights_mirror(c),
                                lora=spec, base_model=os.path.abspath(model_path),
                                push_merged=c.model.lora.push == "merged")
    publish_weights(publisher, client, state.params, start_step, rollback=resume, frozen=state.frozen)
    server = None
    if client is None:  # one process (checked above): its own child service
        with phase(f"starting the generation service (its log: {os.path.join(local_out, 'serve.log')})"):
            server = stack.enter_context(LocalServer(
                publisher.local_path(start_step), dtype=compute_dtype, weight_version=start_step,
                log_path=os.path.join(local_out, "serve.log"), extra_args=child_service_args(c),
                api_key_env=c.rollout.api_key_env, weights_roots=weights_roots(c), mesh=c.rollout.service_mesh))
        if server.url is None:  # entering the context waits until the service answers at its URL
            raise RuntimeError("the local generation service started without a URL")
        # Given the server, the client restarts it if it dies and redoes the rollout (metrics: service_restarts).
        client = stack.enter_context(RolloutClient([server.url], timeout_s=c.rollout.timeout_s,
                                                   api_key=api_key(c.rollout.api_key_env), local_server=server,
                                                   vocab_size=model_config.vocab_size))
    pusher = None
    if weight_sync == "shm":
        pusher = stack.enter_context(SegmentPusher(graphdef, merged_lora=spec is not None))
    actor = Actor(client, scorer, tokenizer, episodes, _router_shape(c, model_config))
    source = RoundSource(c, actor, PromptStream(dataset, c.rollout.prompts_per_step, c.run.seed, position), dataset)
    push = functools.partial(_push, publisher, client, pusher)
    queue = stack.enter_context(RolloutQueue(c, source, push, frozen_base=state.frozen is not None,
                                             checkpoint_due=functools.partial(_due, checkpointer, c.train.steps),
                                             resumed=queued))
    learner = Learner(mesh, jit_train_step(graphdef, optimizer, schedule, train_config, shardings, mesh),
                      jit_policy_logprobs(graphdef, logprob_config, params_shardings, mesh, frozen_shardings),
                      c.algorithm, c.run.seed)
    recorder = Recorder(c, checkpointer, log, publisher, tokenizer, start_step, compute_dtype)
    return Roles(actor, learner, queue, recorder, dataset.eval), state


def _push(publisher: WeightPublisher, client: RolloutClient, pusher: SegmentPusher | None, params: nnx.State,
          version: int, frozen: nnx.State | None, *, rollback: bool = False) -> None:
    """Version `version` to every service (`publish_weights`)."""
    publish_weights(publisher, client, params, version, rollback=rollback, frozen=frozen, pusher=pusher)


def _due(checkpointer: Checkpointer, steps: int, step: int) -> bool:
    """Whether a checkpoint is saved after `step` steps (the last one always is)."""
    return checkpointer.due(step, force=step == steps)


def _router_shape(config: Config, model: DecoderConfig) -> RouterShape | None:
    """The routed experts a completion brings back under model.moe.router_replay (None: off)."""
    if not config.model.moe.router_replay:
        return None
    return RouterShape(model.num_layers, model.experts_per_token, model.num_experts)
