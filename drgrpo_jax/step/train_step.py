"""The pure training step: one optimizer window in, updated state and global metrics out.

Shape letters (docs/shape_letters.md): N responses in the window, U prompt positions (left-padded),
T response positions (right-padded, T = the generation budget), S = U + T - 1 positions of one forward
(prompt and response but the last token), D model dim.

`train_step` takes the window's global statistics (N_w, T_w), scans over micro-batches (the policy's chunked
log-probs, the reference's when KL is on, `loss_fn`, gradients accumulated), then makes one optax update. With
LoRA (`TrainState.frozen` holds the base) only the adapters train, against the base with the adapters off.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.errors import PackingError
from drgrpo_jax.losses import WindowStats, kl_divergence, loss_fn, window_stats
from drgrpo_jax.models.moe import RouterStats, load_balancing_loss, router_z_loss
from drgrpo_jax.sharding import batch_sharding, batch_shards, traced_on_mesh
from drgrpo_jax.step.batch import Batch, pack_demand, pack_spec, split_micro_batches
from drgrpo_jax.step.config import StepConfig, importance_weights
from drgrpo_jax.step.metrics import StepMetrics, TokenMeans, router_metrics
from drgrpo_jax.step.optimizer import AdamW
from drgrpo_jax.step.packing import PackSpec
from drgrpo_jax.step.policy import merge_model, policy_forward, policy_logprobs, response_logprobs

__all__ = ["TrainState", "init_state", "jit_policy_logprobs", "jit_train_step", "train_step"]


@struct.dataclass
class TrainState:
    """Everything the step changes, the frozen reference (None unless KL is on) and the frozen base (LoRA).

    With LoRA adapters, `params` holds only the adapters (the gradients and the optimizer state are theirs)
    and `frozen` the base weights; the KL reference is then the base with the adapters off, so
    `ref_params` stays None. Checkpoints leave `frozen` out (`checkpointed`): it is reloaded from model.path.
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer windows consumed (skipped ones included)
    rng: jax.Array  # root key; per-step keys are fold_in(rng, step)
    ref_params: nnx.State | None = None
    frozen: nnx.State | None = None  # LoRA: the base weights, never updated

    def checkpointed(self, *, optimizer: bool = True) -> TrainState:
        """What a checkpoint holds: everything but the frozen base (and, `optimizer` False, the optimizer's state)."""
        return dataclasses.replace(self, frozen=None, opt_state=self.opt_state if optimizer else None)


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation, rng: jax.Array,
               *, with_reference: bool = False) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, state) from a model; the reference is a copy of the initial policy.

    A model with LoRA adapters (`models.lora.add_adapters`) trains them alone: `params` are the adapters,
    `frozen` the base, and no reference copy is made (the reference is the base with the adapters off).
    """
    if nnx.state(model, nnx.LoRAParam):
        graphdef, params, *rest = nnx.split(model, nnx.LoRAParam, nnx.Param)
        frozen = rest[0]
        return graphdef, TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                                    rng=rng, frozen=frozen)
    graphdef, params = nnx.split(model, nnx.Param)
    ref = jax.tree.map(jnp.copy, params) if with_reference else None
    return graphdef, TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                                rng=rng, ref_params=ref)


# ------------------------------------------------------------------ the loss of one micro-batch


def _reference(params, ref_params, frozen, config: StepConfig):
    """The reference's trainable part: its own copy, or with LoRA zero adapters (the base alone); None = no KL."""
    if ref_params is not None:
        return ref_params
    if frozen is not None and config.loss.kl_coef > 0:
        return jax.tree.map(jnp.zeros_like, params)  # B = 0: exactly the base, no second copy of its weights
    return None


def _micro_loss(params, graphdef, config: StepConfig, window: WindowStats, ref_params, frozen,
                micro: Batch[jax.Array], lora_key: jax.Array, packing: PackSpec | None = None, grad_sums=None,
                moe: bool = False):
    """This micro-batch's share of the window's loss, and (its `TokenMeans` shares, a mixture's `RouterStats` or None)
    (`grad_sums`: see response_logprobs; `moe`: the policy is a mixture of experts)."""
    logprobs, entropy, stats = policy_forward(
        graphdef, params, micro.prompt_ids, micro.prompt_mask, micro.response_ids, micro.response_mask,
        temperature=config.temperature, chunk=config.logprob_chunk, compute_dtype=config.compute_dtype, frozen=frozen,
        lora_key=lora_key, packing=packing, row_valid=micro.row_valid, grad_sums=grad_sums,
        routed_experts=micro.routed_experts, router_stats=moe)
    ref_logprobs = None
    reference = _reference(params, ref_params, frozen, config)
    if reference is not None:
        ref_logprobs = jax.lax.stop_gradient(response_logprobs(
            graphdef, reference, micro.prompt_ids, micro.prompt_mask, micro.response_ids, micro.response_mask,
            temperature=config.temperature, chunk=config.logprob_chunk, compute_dtype=config.compute_dtype,
            frozen=frozen, packing=packing, row_valid=micro.row_valid, routed_experts=micro.routed_experts)[0])
    old_logprobs = jax.lax.stop_gradient(logprobs) if config.on_policy else micro.old_logprobs
    loss_mask = micro.tokens_in_loss()
    token = loss_mask & micro.row_valid[:, None]
    advantages = jnp.broadcast_to(micro.advantages[:, None], logprobs.shape)
    mismatch = jnp.where(token, old_logprobs - micro.behaviour_logprobs, 0.0)
    tis_weight, truncated, dropped = importance_weights(mismatch, config)
    if config.tis_cap is not None or config.mis_high is not None:
        # A non-negative per-token weight on the advantage scales exactly the policy-gradient term.
        advantages = advantages * tis_weight
    loss, loss_metrics = loss_fn(logprobs, old_logprobs, advantages, loss_mask, config=config.loss,
                                 ref_logprobs=ref_logprobs, entropy=entropy, window=window, row_valid=micro.row_valid)

    def token_share(x):
        return jnp.where(window.num_tokens > 0, jnp.where(token, x, 0.0).sum() / jnp.maximum(window.num_tokens, 1), 0.0)

    behaviour_kl = kl_divergence(micro.behaviour_logprobs, old_logprobs, "k3")
    means = TokenMeans.of_loss(loss_metrics, behaviour_kl=token_share(behaviour_kl), tis_weight=token_share(tis_weight),
                               is_truncated=token_share(truncated.astype(jnp.float32)),
                               is_dropped=token_share(dropped.astype(jnp.float32)))
    if stats is not None and (config.router_aux_coef or config.router_z_coef):
        # Each micro-batch's own terms, averaged over the window's micro-batches.
        router_loss = config.router_aux_coef * load_balancing_loss(stats) + config.router_z_coef * router_z_loss(stats)
        loss = loss + router_loss / config.micro_batches
    return loss, (means, stats)


def _false_after(tree) -> jax.Array:
    """A False that XLA cannot fold, read from every leaf of `tree`: what depends on it runs after the leaves."""
    firsts = [leaf[(0,) * leaf.ndim].astype(jnp.float32) for leaf in jax.tree.leaves(tree) if leaf.size]  # no gather
    if not firsts:
        return jnp.bool_(False)
    firsts_L = jnp.stack(firsts)
    return jnp.any(jnp.isnan(firsts_L) & jnp.isfinite(firsts_L))


def train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               config: StepConfig, state: TrainState, batch: Batch[jax.Array], *, shards: int = 1
               ) -> tuple[TrainState, StepMetrics]:
    """One optimizer window: accumulate micro-batch gradients, then one update (pure).

    The micro-batch shares sum to the window's loss, so the update depends neither on the number of micro-batches
    nor on the mesh. An empty window (T_w = 0) leaves parameters and optimizer state untouched, counts the step
    and sets `skipped`.

    `shards`: the batch's data-parallel shards (packing: each packs its own responses). A window that overflows the
    packed rows is skipped and counted (`pack_overflow`); `jit_train_step` refuses it before running instead.
    """
    window = window_stats(batch.tokens_in_loss(), batch.row_valid)  # T_w: the model's tokens only
    packing = pack_spec(config, shards)
    step_key = jax.random.fold_in(state.rng, state.step)  # adapter dropout (LoRA); unused otherwise

    def share_of_loss(params, grad_sums, micro, index):
        return _micro_loss(params, graphdef, config, window, state.ref_params, state.frozen, micro,
                           jax.random.fold_in(step_key, index), packing, grad_sums, model_config.moe)

    # Full remat reruns each layer in the backward, which then adds the layer's gradient into the running sum in
    # place: the sum takes the gradient (models/grad_sums.py), no second whole gradient beside it. LoRA's adapters
    # are small, and the other policies keep the forward's values: they add each micro-batch's gradient.
    model = merge_model(graphdef, state.params, state.frozen)
    model_config = model.config
    in_place = state.frozen is None and model.runtime.remat == "full"
    grad_fn = jax.value_and_grad(share_of_loss, argnums=1 if in_place else 0, has_aux=True)

    def accumulate(carry, micro_and_index):
        grads, loss, means, stats = carry
        (micro_loss, (micro_means, micro_stats)), micro_grads = grad_fn(state.params, grads if in_place else None,
                                                                        *micro_and_index)
        grads = micro_grads if in_place else jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, micro_grads)
        means = jax.tree.map(jnp.add, means, micro_means)
        stats = jax.tree.map(jnp.add, stats, jax.lax.stop_gradient(micro_stats))
        return (grads, loss + micro_loss, means, stats), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    stats = None
    if model_config.moe:
        L, e = model_config.num_layers, model_config.num_experts
        stats = RouterStats(counts_Le=jnp.zeros((L, e), jnp.float32), probs_e=jnp.zeros(e, jnp.float32),
                            z=jnp.zeros((), jnp.float32), rows=jnp.zeros((), jnp.float32))
    carry = (zeros, jnp.zeros((), jnp.float32), TokenMeans.zeros(), stats)
    micro_batches = (split_micro_batches(batch, config.micro_batches), jnp.arange(config.micro_batches))
    (grads, loss, means, stats), _ = jax.lax.scan(accumulate, carry, micro_batches)

    skipped, pack_overflow = window.num_tokens == 0, None
    if packing is not None:
        rows, longest = pack_demand(config, batch, shards)
        pack_overflow = ((rows > packing.rows) | (longest > packing.length)).astype(jnp.float32)
        skipped = skipped | (pack_overflow > 0)

    # float32 gradients go in: make_optimizer's moments are float32 and its updates come back in the param dtype.
    if isinstance(optimizer, AdamW):  # in place: no moment held twice (optimizer.py)
        params, opt_state = optimizer.update_or_keep(grads, state.opt_state, state.params, skipped)
    else:
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.tree.where(skipped, state.params, optax.apply_updates(state.params, updates))
        # The donated state is overwritten in place and the params' update reads the old moments: a flag read from
        # the new params orders the moments' overwrite after that read, else XLA first copies every moment.
        opt_state = optax.tree.where(skipped | _false_after(params), state.opt_state, opt_state)
    new_state = dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1)
    metrics = StepMetrics(
        tokens=means,
        router=None if stats is None else router_metrics(stats),
        pack_overflow=pack_overflow,
        loss=loss,
        grad_norm=optax.tree.norm(grads).astype(jnp.float32),
        learning_rate=jnp.asarray(schedule(state.step), jnp.float32),
        num_responses=window.num_responses,
        num_tokens=window.num_tokens,
        skipped=skipped.astype(jnp.float32),
    )
    return new_state, metrics


# ------------------------------------------------------------------ jit with explicit shardings


def state_shardings(state: TrainState, params_shardings: nnx.State, mesh: Mesh,
                    frozen_shardings: nnx.State | None = None) -> TrainState:
    """Shardings of a state: optimizer moments shaped like the params follow them, the rest is replicated.

    `frozen_shardings`: the LoRA base's (`param_shardings(state.frozen, mesh)`), needed when it has one.
    """
    replicated: Any = NamedSharding(mesh, P())  # shardings where the arrays would be
    params_structure = jax.tree.structure(state.params)

    def like_params(node) -> bool:
        return jax.tree.structure(node) == params_structure  # type: ignore[operator]  # jaxlib has no PyTreeDef stub

    return TrainState(
        params=params_shardings,
        opt_state=jax.tree.map(lambda node: params_shardings if like_params(node) else replicated, state.opt_state,
                               is_leaf=like_params),
        step=replicated,
        rng=replicated,
        ref_params=None if state.ref_params is None else params_shardings,
        frozen=None if state.frozen is None else frozen_shardings,
    )


def _refusing_overflow(fn: Callable, config: StepConfig, mesh: Mesh, batch_index: int) -> Callable:
    """`fn` that first raises PackingError when its batch (argument `batch_index`) does not fit the packed rows."""
    if not config.pack_rows:
        return fn
    replicated = NamedSharding(mesh, P())
    demand = jax.jit(functools.partial(pack_demand, config, shards=batch_shards(mesh)),
                     in_shardings=(batch_sharding(mesh),), out_shardings=(replicated, replicated))

    def checked(*args):
        rows, longest = (int(x) for x in demand(args[batch_index]))  # replicated: readable on every process
        if longest > config.pack_length:
            raise PackingError("train.pack_length", f"a response with its prompt needs {longest} tokens, more than "
                                                    f"one packed row of {config.pack_length}")
        if rows > config.pack_rows:
            raise PackingError("train.pack_rows", f"a data shard's responses of one micro-batch need {rows} packed "
                                                  f"rows of {config.pack_length} tokens (first-fit), more than "
                                                  f"{config.pack_rows}; raise it (or train.pack_length)")
        return fn(*args)

    return checked


def jit_train_step(graphdef, optimizer, schedule, config: StepConfig, shardings: TrainState, mesh: Mesh
                   ) -> Callable[[TrainState, Batch], tuple[TrainState, StepMetrics]]:
    """train_step jitted with explicit in/out shardings, donating the state (packing: refusing overflows first)."""
    replicated = NamedSharding(mesh, P())
    step = traced_on_mesh(functools.partial(train_step, graphdef, optimizer, schedule, config,
                                            shards=batch_shards(mesh)), mesh)  # a mixture: expert-parallel
    # One sharding for every field of the batch (a pytree prefix): batches with and without a loss mask both fit.
    rows = batch_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(shardings, rows), out_shardings=(shardings, replicated), donate_argnums=0)
    return _refusing_overflow(jitted, config, mesh, batch_index=1)


def jit_policy_logprobs(graphdef, config: StepConfig, params_shardings: nnx.State, mesh: Mesh,
                        frozen_shardings: nnx.State | None = None) -> Callable[..., jax.Array]:
    """policy_logprobs jitted with the params' and the batch's shardings: fn(params, batch, frozen=None).

    With `frozen_shardings` (LoRA) the function takes the frozen base as its third argument.
    """
    rows = batch_sharding(mesh)
    logprobs = traced_on_mesh(functools.partial(policy_logprobs, graphdef, config, shards=batch_shards(mesh)), mesh)
    if frozen_shardings is None:
        jitted = jax.jit(logprobs, in_shardings=(params_shardings, rows), out_shardings=rows)
        return _refusing_overflow(lambda params, batch, frozen=None: jitted(params, batch), config, mesh, 1)
    return _refusing_overflow(jax.jit(logprobs, in_shardings=(params_shardings, rows, frozen_shardings),
                                      out_shardings=rows), config, mesh, 1)
