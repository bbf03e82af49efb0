"""The policy's forward over a batch: per-token log-probs and entropies of the responses, padded or packed rows.

Shape letters (docs/shape_letters.md): N responses, U prompt positions (left-padded), T response positions
(right-padded), S = U + T - 1 positions of one forward, D model dim; L layers and k experts per token of a mixture.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from drgrpo_jax.models.context_parallel import constrain_tokens, context_ways, from_context_layout, to_context_layout
from drgrpo_jax.models.grad_sums import into_sums
from drgrpo_jax.models.logprobs import token_logprobs
from drgrpo_jax.models.moe import RouterStats
from drgrpo_jax.models.precision import DTYPES, DtypeName, matmul_weights_in
from drgrpo_jax.step.batch import Batch, join_micro_batches, pack_spec, split_micro_batches
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.packing import PackSpec, pack_responses, packed_hidden_states, unpack_responses

__all__ = ["merge_model", "policy_forward", "policy_logprobs", "response_logprobs"]


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None = None) -> Any:
    """The model from its trainable params and, with LoRA, the frozen base."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def _model_inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    """Tokens, positions and segment ids of prompt + response (the last response token is never an input)."""
    tokens = jnp.concatenate([prompt_ids, response_ids], axis=1)[:, :-1]
    real = jnp.concatenate([prompt_mask, response_mask], axis=1)[:, :-1]
    positions = jnp.maximum(jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)
    return tokens, positions, real.astype(jnp.int32)


def response_logprobs(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids, prompt_mask, response_ids,
                      response_mask, *, temperature: float, chunk: int, compute_dtype: DtypeName = "float32",
                      frozen: nnx.State | None = None, lora_key: jax.Array | None = None,
                      packing: PackSpec | None = None, row_valid=None, grad_sums: nnx.State | None = None,
                      routed_experts=None) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies [N, T] of the response tokens under the temperature-scaled policy
    (`policy_forward` without the router's sums)."""
    logprobs, entropy, _ = policy_forward(graphdef, params, prompt_ids, prompt_mask, response_ids, response_mask,
                                          temperature=temperature, chunk=chunk, compute_dtype=compute_dtype,
                                          frozen=frozen, lora_key=lora_key, packing=packing, row_valid=row_valid,
                                          grad_sums=grad_sums, routed_experts=routed_experts)
    return logprobs, entropy


def policy_forward(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids, prompt_mask, response_ids, response_mask,
                   *, temperature: float, chunk: int, compute_dtype: DtypeName = "float32",
                   frozen: nnx.State | None = None, lora_key: jax.Array | None = None, packing: PackSpec | None = None,
                   row_valid=None, grad_sums: nnx.State | None = None, routed_experts=None, router_stats: bool = False
                   ) -> tuple[jax.Array, jax.Array, RouterStats | None]:
    """Per-token log-probs and entropies [N, T] of the response tokens under the temperature-scaled policy, and
    with `router_stats` (a mixture of experts) the router's sums over the real tokens (models/moe.py).

    `compute_dtype="bfloat16"`: every GEMM (the layers', attention's, the vocabulary's, forward and backward)
    rounds its operands to bfloat16 and accumulates in float32 (models/gemm.py), the weights cast inside each
    layer so their gradients come straight from float32 accumulators; the log-softmax, log-probs and entropies
    stay float32. With LoRA (`frozen`: the base weights; `lora_key`: the adapters' dropout, training only) the
    frozen base is cast once up front (`matmul_weights_in`), the adapters like full weights.
    `packing`: the model runs on packed rows (step/packing.py; padding rows, `row_valid` False, are left
    out), with the same values at every response token.
    `grad_sums` (float32 like params; remat `full`, no LoRA) take the gradient, sums + d/d(params) (grad_sums.py).
    `routed_experts` (int32 [N, U + T, L, k], `Batch.routed_experts`): router replay, every layer uses those
    experts for each token, weighted by this policy's router.
    """
    low = None if compute_dtype == "float32" else DTYPES[compute_dtype]
    if low is not None and frozen is not None:
        frozen = matmul_weights_in(frozen, low)  # no gradient: one cast for every layer and micro-batch
    layer_sums = unembed = None
    if grad_sums is not None:
        params, layer_sums, unembed = into_sums(params, grad_sums, unembed_by_caller=True)
    unembed_sum, sum_layout = unembed or (None, "DV")
    model = merge_model(graphdef, params, frozen)
    if low is not None:
        model.runtime = dataclasses.replace(model.runtime, compute_dtype=compute_dtype)
    routed_NSLk = None if routed_experts is None else routed_experts[:, :-1]  # as the tokens: the last never read
    ways = context_ways()
    if ways > 1:
        stats_of = functools.partial(_token_stats, model, ways=ways, lora_key=lora_key, layer_sums=layer_sums,
                                     router_stats=router_stats, temperature=temperature, chunk=chunk, low=low,
                                     unembed_sum=unembed_sum, sum_layout=sum_layout)
        return _split_response_stats(stats_of, prompt_ids, prompt_mask, response_ids, response_mask, packing,
                                     row_valid, routed_NSLk)
    hidden_NTD, stats = _response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, lora_key,
                                         packing, row_valid, layer_sums, routed_NSLk, router_stats)
    logprobs, entropy = token_logprobs(hidden_NTD, model.unembed_DV(), response_ids, temperature=temperature,
                                       chunk_size=chunk, final_logit_softcap=model.config.final_logit_softcap,
                                       compute_dtype=low, unembed_sum=unembed_sum, sum_layout=sum_layout)
    return logprobs, entropy, stats


def _split_response_stats(stats_of, prompt_ids, prompt_mask, response_ids, response_mask, packing, row_valid,
                          routed_NSLk):
    """`policy_forward`'s results where the mesh splits every row's tokens (models/context_parallel.py): the model
    and the log-probs run on all the forward's positions in the context layout, and only the per-token log-probs
    and entropies come back to the responses (a row's hidden states never gather)."""
    T = response_ids.shape[1]
    if packing is not None:
        valid = jnp.ones(prompt_ids.shape[0], bool) if row_valid is None else row_valid
        packed = pack_responses(prompt_ids, prompt_mask, response_ids, response_mask, valid, packing, routed_NSLk)
        logprobs_BS, entropy_BS, stats = stats_of(packed.tokens, packed.targets, packed.positions, packed.segments,
                                                  None, packed.routed)
        both_NT2 = unpack_responses(jnp.stack([logprobs_BS, entropy_BS], axis=-1), packed, T)
        return both_NT2[..., 0], both_NT2[..., 1], stats
    tokens, positions, segments = _model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    targets = jnp.concatenate([prompt_ids, response_ids], axis=1)[:, 1:]
    counted = None if row_valid is None else (segments != 0) & row_valid[:, None]
    logprobs_NS, entropy_NS, stats = stats_of(tokens, targets, positions, segments, counted, routed_NSLk)
    first = prompt_ids.shape[1] - 1  # the input before the first response token
    return logprobs_NS[:, first:], entropy_NS[:, first:], stats


def _token_stats(model, tokens_BS, targets_BS, positions_BS, segments_BS, counted_BS, routed_BSLk, *, ways: int,
                 lora_key, layer_sums, router_stats: bool, temperature: float, chunk: int, low, unembed_sum,
                 sum_layout: str):
    """(log-prob of each target, entropy, RouterStats or None) [B, S] in sequence order, from a forward on the rows
    in the context layout of `ways` shards."""
    S = tokens_BS.shape[1]

    def laid_out(x, fill=0):
        return None if x is None else to_context_layout(x, ways, fill)

    hidden_BTD, stats = model.hidden_states_and_router(laid_out(tokens_BS), laid_out(positions_BS),
                                                       laid_out(segments_BS), lora_key, layer_sums,
                                                       laid_out(routed_BSLk), router_stats, laid_out(counted_BS, False))
    logprobs_BT, entropy_BT = token_logprobs(constrain_tokens(hidden_BTD), model.unembed_DV(), laid_out(targets_BS),
                                             temperature=temperature, chunk_size=chunk,
                                             final_logit_softcap=model.config.final_logit_softcap, compute_dtype=low,
                                             unembed_sum=unembed_sum, sum_layout=sum_layout, context=ways)
    return from_context_layout(logprobs_BT, ways, S), from_context_layout(entropy_BT, ways, S), stats


def _response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, lora_key, packing, row_valid,
                     layer_sums=None, routed_NSLk=None, router_stats=False):
    """([N, T, D]: the final hidden state before each response token (it predicts that token), RouterStats or
    None)."""
    if packing is not None:
        valid = jnp.ones(prompt_ids.shape[0], bool) if row_valid is None else row_valid
        return packed_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, valid, packing,
                                    lora_key, layer_sums, routed_NSLk, router_stats)
    tokens, positions, segments = _model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    counted = None if row_valid is None else (segments != 0) & row_valid[:, None]  # a padding row's are not
    hidden_NSD, stats = model.hidden_states_and_router(tokens, positions, segments, lora_key, layer_sums, routed_NSLk,
                                                       router_stats, counted)
    return hidden_NSD[:, prompt_ids.shape[1] - 1:], stats


def policy_logprobs(graphdef: nnx.GraphDef, config: StepConfig, params: nnx.State, batch: Batch,
                    frozen: nnx.State | None = None, *, shards: int = 1) -> jax.Array:
    """The policy's log-probs [N, T] of a batch's responses (the trainer's old log-probs).

    `shards`: the batch's data-parallel shards (the mesh's data x fsdp), each packing its own responses.
    """
    packing = pack_spec(config, shards)

    def one(micro):
        return response_logprobs(graphdef, params, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                 micro.response_mask, temperature=config.temperature, chunk=config.logprob_chunk,
                                 compute_dtype=config.compute_dtype, frozen=frozen, packing=packing,
                                 row_valid=micro.row_valid, routed_experts=micro.routed_experts)[0]

    return join_micro_batches(jax.lax.map(one, split_micro_batches(batch, config.micro_batches)))
