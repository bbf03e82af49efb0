"""Peak memory and time of chunked vs naive (full-logits) token log-probs, forward + backward.

Usage: python benchmarks/logprobs.py [--batch 8 --length 512 --dim 576 --vocab 49152 --chunk 256]
Prints one JSON line, both paths in it. Memory is XLA's compiled temp-buffer size (the live intermediates of the
program; arguments and outputs excluded), the quantity chunking is meant to cut.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from drgrpo_jax.models.logprobs import naive_token_logprobs, token_logprobs


def _measure(name: str, fn, args, repeats: int = 3) -> dict:
    """Compile fn, report its temp memory and median wall time."""
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {"path": name, "temp_bytes": int(memory.temp_size_in_bytes),
            "seconds_median": sorted(times)[len(times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--dim", type=int, default=576)  # SmolLM2-135M
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (args.batch, args.length, args.dim), dtype)
    unembed = (0.05 * jax.random.normal(k2, (args.dim, args.vocab))).astype(dtype)
    targets = jax.random.randint(k3, (args.batch, args.length), 0, args.vocab)

    def grad_of(logprob_fn):
        def loss(h, u):
            logprobs, entropy = logprob_fn(h, u, targets)
            return jnp.sum(logprobs) + 0.01 * jnp.sum(entropy)
        return jax.grad(loss, argnums=(0, 1))

    full_logits_bytes = args.batch * args.length * args.vocab * 4
    shape = {"batch": args.batch, "length": args.length, "dim": args.dim, "vocab": args.vocab, "dtype": args.dtype,
             "full_f32_logits_bytes": full_logits_bytes, "backend": jax.default_backend()}
    chunked = lambda h, u, t: token_logprobs(h, u, t, chunk_size=args.chunk)  # noqa: E731
    naive = _measure("naive", grad_of(naive_token_logprobs), (hidden, unembed))
    chunk = _measure(f"chunked_{args.chunk}", grad_of(chunked), (hidden, unembed))
    print(json.dumps({"benchmark": "logprobs", **shape, "naive": naive, "chunked": chunk,
                      "chunked_over_naive_temp_bytes": round(chunk["temp_bytes"] / max(naive["temp_bytes"], 1), 3)}))


if __name__ == "__main__":
    main()
