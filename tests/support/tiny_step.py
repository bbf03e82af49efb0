"""The sharded training step on the tiny model (tiny_models.tiny_decoder_config): its window of ragged
responses, runs of the jitted step on a (data, fsdp, tensor) mesh shared between runs of one configuration,
LoRA steps, and the tolerance runs are compared at."""

from __future__ import annotations

import functools

import numpy as np

from support.tiny_models import tiny_decoder_config

# ---------------------------------------------------------------------------------------------
# The step's window (tests/step/, tests/models/, support/multihost_worker.py)
# ---------------------------------------------------------------------------------------------

STEP_ROWS, STEP_PROMPT, STEP_RESPONSE = 16, 6, 12


def make_step_batch(seed=0, lengths=None):
    """A window of responses of very different lengths, long ones packed onto the first shards."""
    from drgrpo_jax.step.batch import Batch

    rows, prompt, response = STEP_ROWS, STEP_PROMPT, STEP_RESPONSE
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(1, prompt + 1, rows)
    prompt_mask = np.arange(prompt)[None, :] >= prompt - prompt_lengths[:, None]  # left-padded
    if lengths is None:
        lengths = np.array([12, 12, 11, 12, 10, 12, 9, 12, 1, 2, 0, 3, 1, 1, 2, 0])
    response_mask = np.arange(response)[None, :] < lengths[:, None]
    row_valid = np.ones(rows, bool)
    row_valid[-1] = False  # a padding row
    return Batch(
        prompt_ids=np.where(prompt_mask, rng.integers(0, 64, (rows, prompt)), 0).astype(np.int32),
        prompt_mask=prompt_mask,
        response_ids=np.where(response_mask, rng.integers(0, 64, (rows, response)), 0).astype(np.int32),
        response_mask=response_mask,
        advantages=rng.normal(size=rows).astype(np.float32),
        old_logprobs=np.zeros((rows, response), np.float32),  # filled by the policy before the step
        behaviour_logprobs=np.zeros((rows, response), np.float32),
        row_valid=row_valid,
    )


# ---------------------------------------------------------------------------------------------
# The sharded training step on the tiny model (tests/step/, tests/models/)
# ---------------------------------------------------------------------------------------------

COMPILES: list[str] = []  # one entry per program XLA compiled or took from the persistent cache (conftest)


def _count_compiles() -> None:
    """Registers the COMPILES listeners once per process."""
    import jax

    if getattr(_count_compiles, "registered", False):
        return
    _count_compiles.registered = True  # type: ignore[attr-defined]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    jax.monitoring.register_event_listener(
        lambda name, **_: COMPILES.append(name) if name == "/jax/compilation_cache/cache_hits" else None)


@functools.cache
def initial_old_logprobs(lengths: tuple[int, ...] | None) -> np.ndarray:
    """The initial policy's log-probs of a batch, computed once on one device and shared by every run."""
    import jax
    from flax import nnx

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.policy import policy_logprobs

    graphdef, params = nnx.split(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0)), nnx.Param)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), logprob_chunk=5)
    batch = make_step_batch(lengths=None if lengths is None else np.array(lengths))
    return np.asarray(jax.jit(functools.partial(policy_logprobs, graphdef, config))(params, batch))


_STEP_FUNCTIONS: dict = {}  # run_step's (mesh, optimizer, shardings, step, old log-probs) per configuration


def run_step(mesh_shape, micro_batches, aggregation="fixed_budget", lengths=None, steps=1, kl_coef=0.0,
             optimizer=None, tis_cap=None, behaviour_shift=0.0, on_policy=False, loss_options=(), remat="none",
             **step_options):
    """Params and metrics after `steps` steps of the tiny model (under `remat`) on a (data, fsdp, tensor) mesh.

    The first step's old log-probs come from one shared single-device computation (so only
    the train step compiles per mesh); later steps recompute them on the mesh. With the default optimizer the
    jitted step is built once per configuration (mesh, split, loss and step options) and shared by every run.
    """
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.models.config import RuntimeOptions
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.train_step import init_state, jit_policy_logprobs, jit_train_step, state_shardings

    _count_compiles()
    # With the default optimizer the jitted functions depend only on these options (the lengths, the behaviour
    # shift and the step count are data), so runs that repeat a configuration share them: jax traces and lowers a
    # new jitted callable every time, even for the same program (~0.5 s a step on 2 cores).
    config_key = None if optimizer is not None else (
        tuple(mesh_shape), micro_batches, aggregation, kl_coef, tis_cap, on_policy, remat,
        tuple(sorted(dict(loss_options).items())), tuple(sorted(step_options.items())))
    cached = _STEP_FUNCTIONS.get(config_key) if config_key is not None else None
    if cached is None:
        data, fsdp, tensor = mesh_shape
        mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor])
        optimizer = optimizer or optax.sgd(0.5)
    else:
        mesh, optimizer, shardings, step, old_logprobs = cached
    runtime = RuntimeOptions(remat=remat)
    model = shard_model(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0), runtime=runtime), mesh)
    graphdef, state = init_state(model, optimizer, jax.random.key(0), with_reference=kl_coef > 0)
    if cached is None:
        loss = LossConfig(aggregation=aggregation, budget=STEP_RESPONSE, kl_coef=kl_coef, **dict(loss_options))
        config = StepConfig(loss=loss,
                            micro_batches=micro_batches, tis_cap=tis_cap, logprob_chunk=5, on_policy=on_policy,
                            **step_options)
        params_shardings = param_shardings(state.params, mesh)
        shardings = state_shardings(state, params_shardings, mesh)
        step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.5), config, shardings, mesh)
        old_logprobs = jit_policy_logprobs(graphdef, config, params_shardings, mesh)
        if config_key is not None:
            _STEP_FUNCTIONS[config_key] = mesh, optimizer, shardings, step, old_logprobs
    state = jax.device_put(state, shardings)
    key = None if lengths is None else tuple(int(n) for n in lengths)
    batch = place(make_step_batch(lengths=lengths), batch_sharding(mesh))
    history = []
    for i in range(steps):
        old = jax.device_put(initial_old_logprobs(key), batch.old_logprobs.sharding) if i == 0 else \
            old_logprobs(state.params, batch)
        batch = dataclasses.replace(batch, old_logprobs=jnp.full_like(old, jnp.nan) if on_policy else old,
                                    behaviour_logprobs=old + behaviour_shift)  # on-policy: old_logprobs unused
        state, metrics = step(state, batch)
        history.append(dict(jax.device_get(metrics).row(), compiles_so_far=len(COMPILES)))  # metrics.jsonl keys
    return jax.device_get(state), history, step


def lora_step_fn(model, mesh_shape, micro_batches):
    """(placed state, one(state) -> (state, metrics), frozen shardings): on-policy LoRA steps (KL on, Adam) of a
    model carrying adapters on a (data, fsdp, tensor) mesh; each step recomputes its old log-probs on the mesh."""
    import dataclasses

    import jax
    import optax

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.train_step import init_state, jit_policy_logprobs, jit_train_step, state_shardings

    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:data * fsdp * tensor])
    optimizer = optax.adam(0.01, eps=1e-3)  # eps keeps Adam's first step from amplifying rounding in tiny gradients
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE, kl_coef=0.1), micro_batches=micro_batches,
                        logprob_chunk=5)
    graphdef, state = init_state(model, optimizer, jax.random.key(0))
    params_shardings, frozen_shardings = param_shardings(state.params, mesh), param_shardings(state.frozen, mesh)
    shardings = state_shardings(state, params_shardings, mesh, frozen_shardings)
    step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.01), config, shardings, mesh)
    logprobs = jit_policy_logprobs(graphdef, config, params_shardings, mesh, frozen_shardings)
    batch = place(make_step_batch(), batch_sharding(mesh))

    def one(state):
        old = logprobs(state.params, batch, state.frozen)
        return step(state, dataclasses.replace(batch, old_logprobs=old, behaviour_logprobs=old))

    return jax.device_put(state, shardings), one, frozen_shardings


def assert_same(actual, desired, what):
    """Trees equal to float32 tolerance (relative to each leaf's largest entry)."""
    import jax

    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
        d = np.asarray(d)
        np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-5 * max(np.abs(d).max(), 1e-6), err_msg=what)
