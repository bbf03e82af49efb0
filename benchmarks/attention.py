"""Self-attention alone, forward+backward: reference, blockwise kernel and PyTorch's SDPA; time and temporaries.

Prints one JSON line. SmolLM2-135M's heads by default (Q=9 query heads, C=3 kv heads, H=64), causal,
float32, B rows of S tokens; for each length and implementation the median wall time of a jitted
forward+backward (gradients of q, k, v) and the compiled program's temporary bytes (XLA's
memory_analysis: a property of the program, what a step must find free), measured in the same run.
The peer, `torch_sdpa`, is `torch.nn.functional.scaled_dot_product_attention` (causal, grouped kv heads)
forward+backward on the same shapes and dtype; each of our rows of a length carries `speedup_vs_torch_sdpa`
(torch's seconds over ours).

    python benchmarks/attention.py [--rows 2] [--lengths 128,512,2048,4096]
        [--impls reference,blockwise,torch_sdpa] [--blocks 256,512]
"""

import argparse
import json

import jax
import jax.numpy as jnp

from drgrpo_jax.models import attention as attention_module
from drgrpo_jax.models.attention import attention

from _common import median_time


def measure(impl: str, rows: int, length: int, heads: tuple[int, int, int], dtype, repeats: int) -> dict:
    Q, C, H = heads
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, length, Q, H), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (rows, length, C, H), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (rows, length, C, H), jnp.float32).astype(dtype)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
    segments = jnp.ones((rows, length), jnp.int32)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32).astype(dtype)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, positions, segments, scale=H**-0.5, impl=impl), q, k, v)
        return out, vjp(cotangent)

    compiled = jax.jit(forward_backward).lower(q, k, v).compile()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(q, k, v))
    seconds = median_time(lambda: jax.block_until_ready(compiled(q, k, v)), repeats)
    return {"impl": impl, "S": length, "fwd_bwd_s": round(seconds, 4), "temp_gb": round(temp_bytes / 1e9, 3)}


def measure_torch(rows: int, length: int, heads: tuple[int, int, int], dtype: str, repeats: int) -> dict:
    """PyTorch's scaled_dot_product_attention forward+backward, causal, C kv heads shared by Q query heads."""
    import torch

    Q, C, H = heads
    generator = torch.Generator().manual_seed(0)

    def normal(*shape, grad=True):
        return torch.randn(*shape, generator=generator).to(getattr(torch, dtype)).requires_grad_(grad)

    q, k, v = normal(rows, Q, length, H), normal(rows, C, length, H), normal(rows, C, length, H)
    cotangent = normal(rows, Q, length, H, grad=False)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(cotangent)

    forward_backward()
    seconds = median_time(forward_backward, repeats)
    return {"impl": "torch_sdpa", "S": length, "fwd_bwd_s": round(seconds, 4), "torch_threads": torch.get_num_threads()}


def with_ratios(results: list[dict]) -> list[dict]:
    """Each of our rows with `speedup_vs_torch_sdpa` where the peer ran at its length."""
    peer = {r["S"]: r["fwd_bwd_s"] for r in results if r["impl"] == "torch_sdpa"}
    return [r if r["impl"] == "torch_sdpa" or r["S"] not in peer else
            {**r, "speedup_vs_torch_sdpa": round(peer[r["S"]] / r["fwd_bwd_s"], 3)} for r in results]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--lengths", default="128,512,2048,4096")
    parser.add_argument("--impls", default="reference,blockwise,torch_sdpa")
    parser.add_argument("--heads", default="9,3,64", help="Q,C,H")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks", default=str(attention_module.DEFAULT_BLOCK_SIZE),
                        help="blockwise block sizes to compare, e.g. 256,512")
    args = parser.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    results = []
    for length in args.lengths.split(","):
        for impl in args.impls.split(","):
            if impl == "torch_sdpa":
                results.append(measure_torch(args.rows, int(length), heads, args.dtype, args.repeats))
                continue
            for block in args.blocks.split(",") if impl == "blockwise" else [None]:
                if block is not None:
                    attention_module.DEFAULT_BLOCK_SIZE = int(block)
                result = measure(impl, args.rows, int(length), heads, jnp.dtype(args.dtype), args.repeats)
                results.append(result if block is None else {**result, "block": int(block)})
    print(json.dumps({"benchmark": "attention", "heads_QCH": heads, "rows": args.rows, "dtype": args.dtype,
                      "backend": jax.default_backend(), "results": with_ratios(results)}))


if __name__ == "__main__":
    main()
