"""The pure training step: one optimizer window in, updated state and global metrics out.

Shape letters (the README's glossary): N responses in the window, U prompt positions (left-padded),
T response positions (right-padded, T = the generation budget), S = U + T - 1 positions of one forward
(prompt and response but the last token), D model dim.

`train_step(state, batch)` first takes the window's statistics (N_w, T_w; global over the
mesh because the arrays are global), then scans over micro-batches, each computing the
policy's log-probs with the model (chunked, never full float32 logits), the reference's
when KL is on, and `loss_fn` with the window's statistics, accumulating gradients; then one
optax update. The micro-batch shares sum to the window's loss, so the update depends neither
on the number of micro-batches nor on the mesh. An empty window (T_w = 0) leaves parameters
and optimizer state untouched, counts the step and sets `skipped`. With LoRA adapters
(`TrainState.frozen` holds the base) the gradients, the optimizer state and the update cover the
adapters alone, and the reference is the base with the adapters off.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.errors import FieldError, FieldTypeError
from drgrpo_jax.losses import LossConfig, WindowStats, kl_divergence, loss_fn, window_stats
from drgrpo_jax.models.logprobs import token_logprobs
from drgrpo_jax.models.precision import COMPUTE_DTYPES, ComputeDtype, matmul_weights_in

__all__ = ["Batch", "StepConfig", "TrainState", "importance_weights", "in_float32", "init_state", "jit_policy_logprobs",
           "jit_train_step", "make_optimizer", "place", "policy_logprobs", "shard_batch", "train_step"]

BATCH_AXES = ("data", "fsdp")  # mesh axes the response dimension N is split over


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

    def checkpointed(self) -> TrainState:
        """What a checkpoint holds: everything but the frozen base."""
        return dataclasses.replace(self, frozen=None)


ArrayT = TypeVar("ArrayT")  # what a Batch holds: np.ndarray on the host, jax.Array on the mesh (or its shardings)


@struct.dataclass
class Batch(Generic[ArrayT]):
    """One rollout batch of N responses, as arrays with N leading."""

    prompt_ids: ArrayT  # int32 [N, U], left-padded
    prompt_mask: ArrayT  # bool [N, U]
    response_ids: ArrayT  # int32 [N, T], right-padded
    response_mask: ArrayT  # bool [N, T]: tokens that count in the loss
    advantages: ArrayT  # float32 [N]
    old_logprobs: ArrayT  # float32 [N, T]: the policy before this update (recomputed by the trainer)
    behaviour_logprobs: ArrayT  # float32 [N, T]: the sampler's, for TIS and the mismatch metric
    row_valid: ArrayT  # bool [N]: False = a padding row added for static shapes


ImportanceLevel = Literal["token", "sequence"]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step computes; static under jit; validated at construction (FieldError naming the field)."""

    loss: LossConfig  # aggregation, clipping, KL and entropy terms
    micro_batches: int = 1  # gradient-accumulation slices of one window
    temperature: float = 1.0  # the sampler's temperature; log-probs use the same scaling
    tis_cap: float | None = None  # truncated importance sampling: cap C >= 1 on exp(old - behaviour); None = off
    tis_level: ImportanceLevel = "token"  # tis_cap's and mis_high's ratio: per token or per response
    mis_high: float | None = None  # masked importance sampling: weight 0 above this ratio (>= 1), else the ratio
    mis_low: float = 0.0  # masked importance sampling: weight 0 below this ratio too, in [0, 1]
    logprob_chunk: int = 256  # tokens per chunk of the vocabulary projection
    # The rollout gets exactly one optimizer window (one epoch, one minibatch): the old policy IS the current
    # one, so its log-probs are this forward's with the gradient stopped and the batch's old_logprobs are unused.
    on_policy: bool = False
    # Mixed precision: "bfloat16" runs the model's GEMMs on a bfloat16 copy of the projection and unembedding
    # weights (float32 accumulation) while params, gradients, optimizer state, log-probs and the loss stay float32.
    compute_dtype: ComputeDtype = "float32"

    def __post_init__(self):
        for name, kinds in [("micro_batches", int), ("logprob_chunk", int), ("temperature", (int, float)),
                            ("tis_cap", (int, float, type(None)))]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                wanted = "an int" if kinds is int else "a number"
                raise FieldTypeError("StepConfig", name, f"must be {wanted}, got {type(value).__name__} {value!r}")
        if not isinstance(self.on_policy, bool):
            raise FieldTypeError("StepConfig", "on_policy", f"must be a bool, got {self.on_policy!r}")
        for name in ("micro_batches", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise FieldError("StepConfig", name, f"must be an int >= 1, got {getattr(self, name)}")
        if not 0 < self.temperature < float("inf"):
            raise FieldError("StepConfig", "temperature",
                             f"must be finite and > 0 for training log-probs, got {self.temperature}")
        # C < 1 would weight even on-policy tokens (ratio 1) by C: a smaller learning rate, not a truncation.
        if self.tis_cap is not None and not 1 <= self.tis_cap < float("inf"):
            raise FieldError("StepConfig", "tis_cap", "must be finite and >= 1 (a cap on an importance ratio), "
                                                      f"got {self.tis_cap}")
        self._check_masked_is()
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise FieldError("StepConfig", "compute_dtype", f"unknown {self.compute_dtype!r}; choose one of "
                                                            f"{sorted(COMPUTE_DTYPES)}")

    def _check_masked_is(self):
        if self.tis_level not in get_args(ImportanceLevel):
            raise FieldError("StepConfig", "tis_level", f"unknown {self.tis_level!r}; choose one of "
                                                        f"{get_args(ImportanceLevel)}")
        for name, kinds in [("mis_high", (int, float, type(None))), ("mis_low", (int, float))]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise FieldTypeError("StepConfig", name, f"must be a number, got {type(value).__name__} {value!r}")
        if self.mis_high is not None and not 1 <= self.mis_high < float("inf"):
            raise FieldError("StepConfig", "mis_high", f"must be finite and >= 1 (on-policy tokens have ratio 1), "
                                                       f"got {self.mis_high}")
        if not 0 <= self.mis_low <= 1:
            raise FieldError("StepConfig", "mis_low", f"must be in [0, 1] (on-policy tokens have ratio 1), "
                                                      f"got {self.mis_low}")
        if self.mis_low > 0 and self.mis_high is None:
            raise FieldError("StepConfig", "mis_low", "needs mis_high (masked importance sampling is off)")
        if self.mis_high is not None and self.tis_cap is not None:
            raise FieldError("StepConfig", "mis_high", "and tis_cap correct the same mismatch two ways; set one")


def make_optimizer(
    learning_rate: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    decay: str = "constant",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then constant/cosine/linear decay, after global-norm clipping."""
    decay_steps = max(total_steps - warmup_steps, 1)
    after_warmup = {
        "constant": lambda: optax.constant_schedule(learning_rate),
        "cosine": lambda: optax.cosine_decay_schedule(learning_rate, decay_steps),
        "linear": lambda: optax.linear_schedule(learning_rate, 0.0, decay_steps),
    }
    if decay not in after_warmup:
        raise ValueError(f"optimizer.decay: unknown {decay!r}; choose one of {sorted(after_warmup)}")
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps else None
    schedule = (
        optax.join_schedules([warmup, after_warmup[decay]()], [warmup_steps]) if warmup else after_warmup[decay]()
    )
    clip = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    adamw = optax.chain(*clip, optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return in_float32(adamw), schedule


def _to_float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with float32 state and arithmetic whatever the param dtype; updates come back in the param dtype.

    Adam's second moment of a bfloat16 run underflows and rounds (8 mantissa bits), so the moments,
    the clipping norm and the weight decay are float32; only the update is cast to each parameter's dtype.
    """

    def init(params):
        return inner.init(_to_float32(params))

    def update(grads, state, params=None):
        updates, state = inner.update(_to_float32(grads), state, None if params is None else _to_float32(params))
        like = grads if params is None else params
        return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, like), state

    return optax.GradientTransformation(init, update)


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


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None = None) -> Any:
    """The model from its trainable params and, with LoRA, the frozen base."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


# ------------------------------------------------------------------ log-probs


def _model_inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    """Tokens, positions and segment ids of prompt + response (the last response token is never an input)."""
    tokens = jnp.concatenate([prompt_ids, response_ids], axis=1)[:, :-1]
    real = jnp.concatenate([prompt_mask, response_mask], axis=1)[:, :-1]
    positions = jnp.maximum(jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)
    return tokens, positions, real.astype(jnp.int32)


def response_logprobs(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids, prompt_mask, response_ids,
                      response_mask, *, temperature: float, chunk: int, compute_dtype: ComputeDtype = "float32",
                      frozen: nnx.State | None = None,
                      lora_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies [N, T] of the response tokens under the temperature-scaled policy.

    `compute_dtype="bfloat16"`: the GEMMs run on bfloat16 weights (`matmul_weights_in`) and inputs with
    float32 accumulation; the log-softmax, log-probs and entropies stay float32. With LoRA (`frozen`: the
    base weights; `lora_key`: the adapters' dropout, training only) the cast covers adapters and base alike.
    """
    low = None if compute_dtype == "float32" else COMPUTE_DTYPES[compute_dtype]
    if low is not None:
        params = matmul_weights_in(params, low)
        frozen = None if frozen is None else matmul_weights_in(frozen, low)
    model = merge_model(graphdef, params, frozen)
    tokens, positions, segments = _model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    hidden_NSD = model.hidden_states(tokens, positions, segments, lora_key)
    prompt_len = prompt_ids.shape[1]
    hidden_NTD = hidden_NSD[:, prompt_len - 1:]  # the state before each response token predicts it
    return token_logprobs(hidden_NTD, model.unembed_DV(), response_ids, temperature=temperature, chunk_size=chunk,
                          final_logit_softcap=model.config.final_logit_softcap, compute_dtype=low)


def policy_logprobs(graphdef: nnx.GraphDef, config: StepConfig, params: nnx.State, batch: Batch,
                    frozen: nnx.State | None = None) -> jax.Array:
    """The policy's log-probs [N, T] of a batch's responses (the trainer's old log-probs)."""

    def one(micro):
        return response_logprobs(graphdef, params, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                 micro.response_mask, temperature=config.temperature, chunk=config.logprob_chunk,
                                 compute_dtype=config.compute_dtype, frozen=frozen)[0]

    return _unsplit(jax.lax.map(one, _split(batch, config.micro_batches)))


# ------------------------------------------------------------------ micro-batching


def _split(tree, num: int):
    """[N, ...] -> [num, N / num, ...], micro-batch m taking rows m, m + num, ... (spread over every shard)."""

    def one(x):
        rows = x.shape[0]
        if rows % num:
            raise ValueError(f"train.micro_batches: {num} does not divide the window's {rows} responses")
        return jnp.swapaxes(x.reshape(rows // num, num, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, tree)


def _unsplit(x):
    """Inverse of _split for one array."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def importance_weights(mismatch_NT: jax.Array, config: StepConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weight, truncated, dropped) [N, T] of the sampler/trainer mismatch log(pi_old / pi_sampler) per token.

    The ratio is per token, or at tis_level="sequence" the product over each response (a fact of one
    row, so exact under any split by rows). TIS: min(ratio, tis_cap). MIS: the ratio inside
    [mis_low, mis_high], else 0 (the response or token leaves the policy gradient; it still counts in the
    window's N_w and T_w, which are facts of the rollout). Neither: 1.
    """
    log_ratio = mismatch_NT
    if config.tis_level == "sequence":
        log_ratio = jnp.broadcast_to(mismatch_NT.sum(axis=1, keepdims=True), mismatch_NT.shape)
    none = jnp.zeros(mismatch_NT.shape, bool)
    ratio = jnp.exp(log_ratio)  # may overflow to inf at the sequence level: capped or masked below, never used
    if config.tis_cap is not None:
        return jnp.minimum(ratio, config.tis_cap), ratio > config.tis_cap, none
    if config.mis_high is not None:
        inside = (ratio <= config.mis_high) & (ratio >= config.mis_low)
        return jnp.where(inside, ratio, 0.0), none, ~inside
    return jnp.ones(mismatch_NT.shape, jnp.float32), none, none


def _reference(params, ref_params, frozen, config: StepConfig):
    """The reference's trainable part: its own copy, or with LoRA zero adapters (the base alone); None = no KL."""
    if ref_params is not None:
        return ref_params
    if frozen is not None and config.loss.kl_coef > 0:
        return jax.tree.map(jnp.zeros_like, params)  # B = 0: exactly the base, no second copy of its weights
    return None


def _micro_loss(params, graphdef, config: StepConfig, window: WindowStats, ref_params, frozen,
                micro: Batch[jax.Array], lora_key: jax.Array):
    """This micro-batch's share of the window's loss, and its metric shares."""
    logprobs, entropy = response_logprobs(graphdef, params, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                          micro.response_mask, temperature=config.temperature,
                                          chunk=config.logprob_chunk, compute_dtype=config.compute_dtype,
                                          frozen=frozen, lora_key=lora_key)
    ref_logprobs = None
    reference = _reference(params, ref_params, frozen, config)
    if reference is not None:
        ref_logprobs = jax.lax.stop_gradient(response_logprobs(
            graphdef, reference, micro.prompt_ids, micro.prompt_mask, micro.response_ids, micro.response_mask,
            temperature=config.temperature, chunk=config.logprob_chunk, compute_dtype=config.compute_dtype,
            frozen=frozen)[0])
    old_logprobs = jax.lax.stop_gradient(logprobs) if config.on_policy else micro.old_logprobs
    token = micro.response_mask & micro.row_valid[:, None]
    advantages = jnp.broadcast_to(micro.advantages[:, None], logprobs.shape)
    mismatch = jnp.where(token, old_logprobs - micro.behaviour_logprobs, 0.0)
    tis_weight, truncated, dropped = importance_weights(mismatch, config)
    if config.tis_cap is not None or config.mis_high is not None:
        # A non-negative per-token weight on the advantage scales exactly the policy-gradient term.
        advantages = advantages * tis_weight
    loss, metrics = loss_fn(logprobs, old_logprobs, advantages, micro.response_mask, config=config.loss,
                            ref_logprobs=ref_logprobs, entropy=entropy, window=window, row_valid=micro.row_valid)

    def token_share(x):
        return jnp.where(window.num_tokens > 0, jnp.where(token, x, 0.0).sum() / jnp.maximum(window.num_tokens, 1), 0.0)

    metrics["behaviour_kl"] = token_share(kl_divergence(micro.behaviour_logprobs, old_logprobs, "k3"))
    metrics["tis_weight"] = token_share(tis_weight)
    metrics["is_truncated"] = token_share(truncated.astype(jnp.float32))
    metrics["is_dropped"] = token_share(dropped.astype(jnp.float32))
    return loss, metrics


def train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               config: StepConfig, state: TrainState, batch: Batch[jax.Array]
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer window: accumulate micro-batch gradients, then one update (pure)."""
    window = window_stats(batch.response_mask, batch.row_valid)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    step_key = jax.random.fold_in(state.rng, state.step)  # adapter dropout (LoRA); unused otherwise

    def accumulate(carry, micro_and_index):
        grads, loss, metrics = carry
        micro, index = micro_and_index
        (micro_loss, micro_metrics), micro_grads = grad_fn(state.params, graphdef, config, window, state.ref_params,
                                                           state.frozen, micro, jax.random.fold_in(step_key, index))
        grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, micro_grads)
        metrics = jax.tree.map(jnp.add, metrics, micro_metrics)
        return (grads, loss + micro_loss, metrics), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    metric_names = ("pg_loss", "kl", "entropy", "clip_fraction", "approx_kl", "behaviour_kl", "tis_weight",
                    "is_truncated", "is_dropped")
    carry = (zeros, jnp.zeros((), jnp.float32), {k: jnp.zeros((), jnp.float32) for k in metric_names})
    micro_batches = (_split(batch, config.micro_batches), jnp.arange(config.micro_batches))
    (grads, loss, metrics), _ = jax.lax.scan(accumulate, carry, micro_batches)

    # float32 gradients go in: make_optimizer's moments are float32 and its updates come back in the param dtype.
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    skipped = window.num_tokens == 0

    def keep_if_skipped(new, old):
        return jnp.where(skipped, old, new)

    new_state = dataclasses.replace(
        state,
        params=jax.tree.map(keep_if_skipped, params, state.params),
        opt_state=jax.tree.map(keep_if_skipped, opt_state, state.opt_state),
        step=state.step + 1,
    )
    metrics.update(
        loss=loss,
        grad_norm=optax.tree.norm(grads).astype(jnp.float32),
        learning_rate=jnp.asarray(schedule(state.step), jnp.float32),
        num_responses=window.num_responses,
        num_tokens=window.num_tokens,
        skipped=skipped.astype(jnp.float32),
    )
    return new_state, metrics


# ------------------------------------------------------------------ jit with explicit shardings


def batch_shardings(mesh: Mesh) -> Batch:
    """Every batch field split over the data-parallel axes on its leading (response) dimension."""
    rows = NamedSharding(mesh, P(BATCH_AXES))
    return Batch(**{f.name: rows for f in dataclasses.fields(Batch)})


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


def jit_train_step(graphdef, optimizer, schedule, config: StepConfig, shardings: TrainState, mesh: Mesh
                   ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """train_step jitted with explicit in/out shardings, donating the state."""
    replicated = NamedSharding(mesh, P())
    step = functools.partial(train_step, graphdef, optimizer, schedule, config)
    return jax.jit(step, in_shardings=(shardings, batch_shardings(mesh)), out_shardings=(shardings, replicated),
                   donate_argnums=0)


def jit_policy_logprobs(graphdef, config: StepConfig, params_shardings: nnx.State, mesh: Mesh,
                        frozen_shardings: nnx.State | None = None) -> Callable[..., jax.Array]:
    """policy_logprobs jitted with the params' and the batch's shardings: fn(params, batch, frozen=None).

    With `frozen_shardings` (LoRA) the function takes the frozen base as its third argument.
    """
    rows = NamedSharding(mesh, P(BATCH_AXES))
    if frozen_shardings is None:
        jitted = jax.jit(functools.partial(policy_logprobs, graphdef, config),
                         in_shardings=(params_shardings, batch_shardings(mesh)), out_shardings=rows)
        return lambda params, batch, frozen=None: jitted(params, batch)
    return jax.jit(functools.partial(policy_logprobs, graphdef, config),
                   in_shardings=(params_shardings, batch_shardings(mesh), frozen_shardings), out_shardings=rows)


def place(tree: Any, shardings: Any) -> Any:
    """Puts a tree on global shardings, in one process or many (where device_put cannot).

    Arrays already spanning several processes (e.g. loaded straight onto the mesh) must carry
    the asked sharding and are kept; other jax arrays move with device_put in one process; host
    values identical on every process become global arrays shard by shard.
    """

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.sharding.is_equivalent_to(sharding, x.ndim):
                raise ValueError(f"place: a multi-process array has sharding {x.sharding}, expected {sharding}")
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    # `shardings` may be a prefix of `tree` (one sharding per nnx Variable).
    return jax.tree.map(lambda sharding, sub: jax.tree.map(lambda x: one(x, sharding), sub), shardings, tree)


def shard_batch(local: dict[str, Any] | Batch, mesh: Mesh) -> Batch:
    """A global Batch from this process's rows (every process passes its own share, in process order)."""
    local = local if isinstance(local, Batch) else Batch(**local)
    rows = NamedSharding(mesh, P(BATCH_AXES))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows, np.asarray(x)), local)
