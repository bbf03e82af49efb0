"""Model forward+backward and KV-cache decode step on SmolLM2-135M shapes, next to transformers in the same run.

    python benchmarks/model_step.py [--layers 30] [--rows 16] [--seq 192] [--decode-batch 32] [--cache 192]
        [--decode-dtype bfloat16]

Prints one JSON line. Random float32 weights with SmolLM2-135M's shapes (30 layers, D=576, 9 query / 3
kv heads of 64, F=1536, V=49152, tied embeddings), so no download is needed; transformers'
LlamaForCausalLM loads the same weights from our safetensors export.
- forward+backward: gradient of the mean chunked token log-prob (our training path: hidden states,
  then `token_logprobs`) against `model(ids, labels=ids).loss.backward()` in PyTorch; tokens/s and
  achieved GFLOP/s (6 x matmul weights + attention per token, as benchmarks/train_step.py counts).
- decode: one cached step of --decode-batch rows with --decode-filled slots of a --cache-slot cache
  (ours as the sampler runs it: per-layer weights and cache split once, the cache donated, in
  --decode-dtype; transformers with its DynamicCache cropped back after each step).
Timings are medians of --repeats, the two libraries interleaved so machine load hits both alike; the
float32 matmul rate of the moment is measured in between.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig, RopeConfig
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.kv_cache import init_cache, split_cache
from drgrpo_jax.models.logprobs import token_logprobs
from drgrpo_jax.models.transformer import Transformer, layer_params, rope_for_layers


def smollm2_shapes(num_layers: int) -> DecoderConfig:
    """SmolLM2-135M's architecture (random weights)."""
    return DecoderConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=num_layers, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope=RopeConfig(theta=100_000.0), tie_word_embeddings=True, max_position_embeddings=8192)


def flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Forward+backward FLOPs per token: 6 x matmul weights (tied output counted once) + attention."""
    D, F, L, V = config.hidden_size, config.intermediate_size, config.num_layers, config.vocab_size
    attn = D * config.num_heads * config.head_dim * 2 + D * config.num_kv_heads * config.head_dim * 2
    return 6 * (L * (attn + 3 * D * F) + D * V) + 12 * L * seq_len * config.num_heads * config.head_dim


def seconds(fn) -> float:
    """Wall time of one call (fn blocks until its result is ready)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_gflops(size: int = 1536) -> float:
    """The float32 matmul rate XLA reaches right now (the machine is shared; load moves it)."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * size**3 / min(seconds(lambda: f(a).block_until_ready()) for _ in range(3)) / 1e9


def jax_steps(model: Transformer, ids_BT: np.ndarray, decode_batch: int, cache_slots: int, filled: int,
              decode_dtype=jnp.float32):
    """(forward+backward call, decode call), each running one step to completion."""
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = jnp.asarray(ids_BT[:, :-1]), jnp.asarray(ids_BT[:, 1:])

    def loss(params):
        m = nnx.merge(graphdef, params)
        logprobs_BT, _ = token_logprobs(m.hidden_states(inputs), m.unembed_DV(), targets)
        return logprobs_BT.mean()

    grad = jax.jit(jax.grad(loss))

    # The sampler's decode step: weights split per layer and the cache split per layer once, outside the
    # step (generate does so before its loop); each step gets its RoPE tables computed outside too.
    decode_params = jax.tree.map(lambda x: x.astype(decode_dtype), params)
    layers = jax.jit(lambda p: layer_params(nnx.merge(graphdef, p).blocks.arrays(), model.config.num_layers))(
        decode_params)

    def decode(params, layers, cache, ids_B1, positions_B1, rope):
        return nnx.merge(graphdef, params).decode(ids_B1, positions_B1, cache, layers, rope)

    step = jax.jit(decode, donate_argnums=2)
    slots_BS = np.where(np.arange(cache_slots) < filled, np.arange(cache_slots), -1)
    cache = split_cache(init_cache(model.config, decode_batch, cache_slots, dtype=decode_dtype)).replace(
        positions_BS=jnp.asarray(np.broadcast_to(slots_BS, (decode_batch, cache_slots)), jnp.int32),
        length=jnp.asarray(filled, jnp.int32))
    ids_B1 = jnp.asarray(np.resize(ids_BT[:, 0], (decode_batch, 1)))
    positions_B1 = jnp.full((decode_batch, 1), filled, jnp.int32)
    rope = rope_for_layers(model.config, positions_B1)
    holder = [cache]

    def one_decode():
        logits, new_cache = step(decode_params, layers, holder[0], ids_B1, positions_B1, rope)
        holder[0] = new_cache.replace(length=jnp.asarray(filled, jnp.int32))  # rewrite the same slot
        logits.block_until_ready()

    return (lambda: jax.block_until_ready(grad(params))), one_decode


def torch_steps(folder: str, ids_BT: np.ndarray, decode_batch: int, filled: int):
    """transformers (PyTorch CPU, float32): forward+backward of the LM loss, and one cached decode step."""
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.from_numpy(ids_BT).long()

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    prompt = torch.from_numpy(np.resize(ids_BT[:, :filled], (decode_batch, filled))).long()
    cache = DynamicCache()  # filled in place by the prefill, as `generate` does
    with torch.inference_mode():
        model(input_ids=prompt, cache=cache, use_cache=True)
    token = prompt[:, -1:]

    def one_decode():
        with torch.inference_mode():
            model(input_ids=token, cache=cache, use_cache=True)
        cache.crop(-1)  # back to `filled`, so every step attends over `filled` + 1 keys

    return forward_backward, one_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=192)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--cache", type=int, default=192, help="cache slots per row")
    parser.add_argument("--decode-filled", type=int, default=128, help="slots already written before the step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-repeats", type=int, default=10)
    parser.add_argument("--decode-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="our decode step's weight and cache dtype (transformers' stays float32)")
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()

    config = smollm2_shapes(args.layers)
    model = Transformer(config, rngs=nnx.Rngs(0))
    ids_BT = np.random.default_rng(0).integers(0, config.vocab_size, (args.rows, args.seq + 1)).astype(np.int32)
    tokens = args.rows * args.seq
    ours_fb, ours_decode = jax_steps(model, ids_BT, args.decode_batch, args.cache, args.decode_filled,
                                     {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.decode_dtype])
    start = time.perf_counter()
    ours_fb()
    compile_fb = time.perf_counter() - start
    ours_decode()
    theirs_fb = theirs_decode = None
    folder = tempfile.mkdtemp()
    if not args.skip_torch:
        save_pretrained(model, folder)
        theirs_fb, theirs_decode = torch_steps(folder, ids_BT, args.decode_batch, args.decode_filled)
        theirs_fb(), theirs_decode()  # warm-up
    times: dict[str, list[float]] = {"ours_fb": [], "theirs_fb": [], "ours_decode": [], "theirs_decode": [], "mm": []}
    for _ in range(args.repeats):
        times["mm"].append(matmul_gflops())
        times["ours_fb"].append(seconds(ours_fb))
        if theirs_fb:
            times["theirs_fb"].append(seconds(theirs_fb))
        for _ in range(args.decode_repeats):
            times["ours_decode"].append(seconds(ours_decode))
            if theirs_decode:
                times["theirs_decode"].append(seconds(theirs_decode))
    med = {k: float(np.median(v)) for k, v in times.items() if v}
    flops = flops_per_token(config, args.seq) * tokens
    result = {
        "benchmark": "model_step", "model": f"SmolLM2-135M shapes, {args.layers} layers, float32, random weights",
        "fb_batch": f"{args.rows}x{args.seq}",
        "decode": f"batch {args.decode_batch}, {args.decode_filled}/{args.cache} slots",
        "cpus": os.cpu_count(), "jax": jax.__version__, "matmul_gflops_now": round(med["mm"], 1),
        "jax_fb_s": round(med["ours_fb"], 3), "jax_fb_tokens_per_s": round(tokens / med["ours_fb"], 1),
        "jax_fb_gflops": round(flops / med["ours_fb"] / 1e9, 1), "jax_fb_compile_s": round(compile_fb, 1),
        "jax_decode_ms": round(1e3 * med["ours_decode"], 1), "jax_decode_dtype": args.decode_dtype,
    }
    if theirs_fb:
        result.update(torch_fb_s=round(med["theirs_fb"], 3), torch_fb_tokens_per_s=round(tokens / med["theirs_fb"], 1),
                      torch_decode_ms=round(1e3 * med["theirs_decode"], 1),
                      fb_jax_over_torch=round(med["theirs_fb"] / med["ours_fb"], 3),
                      decode_jax_over_torch=round(med["theirs_decode"] / med["ours_decode"], 3))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
