"""Forward+backward time of the jitted loss_fn on a [256, 4096] window next to a plain reduction.

Prints one JSON line. The plain reduction, `-sum(logprobs * advantages * mask) / (N * B)`, is
the cheapest possible loss on the same arrays: the ratio is loss_fn's overhead for its
clipping, KL, entropy, metrics and exact window normalisation.

    python benchmarks/loss_fn.py [--rows 256] [--tokens 4096] [--repeats 20]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.losses import LossConfig, loss_fn


def median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape = (args.rows, args.tokens)
    old = rng.normal(-2, 0.5, shape).astype(np.float32)
    logprobs = (old + rng.normal(0, 0.1, shape)).astype(np.float32)
    ref = (old + rng.normal(0, 0.1, shape)).astype(np.float32)
    entropy = rng.uniform(0, 3, shape).astype(np.float32)
    lengths = rng.integers(1, args.tokens + 1, args.rows)
    mask = np.arange(args.tokens)[None, :] < lengths[:, None]
    adv = rng.normal(size=args.rows).astype(np.float32)
    config = LossConfig(budget=args.tokens, clip_high=0.28, kl_coef=0.01, entropy_coef=0.001)

    @jax.jit
    def full(lp, old, adv, mask, ref, ent):
        def f(lp):
            return loss_fn(lp, old, adv, mask, config=config, ref_logprobs=ref, entropy=ent)

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(lp)
        return loss, metrics, grad

    @jax.jit
    def plain(lp, adv, mask):
        def f(lp):
            return -jnp.sum(lp * adv[:, None] * mask) / (args.rows * args.tokens)

        return jax.value_and_grad(f)(lp)

    t_full = median_seconds(full, (logprobs, old, adv, mask, ref, entropy), args.repeats)
    t_plain = median_seconds(plain, (logprobs, adv, mask), args.repeats)
    print(json.dumps({
        "benchmark": "loss_fn_forward_backward",
        "shape": list(shape),
        "loss_fn_ms": round(t_full * 1e3, 3),
        "plain_reduction_ms": round(t_plain * 1e3, 3),
        "overhead_ratio": round(t_full / t_plain, 2),
        "loss_fn_gb_per_s": round(5 * logprobs.nbytes / t_full / 1e9, 2),  # 5 float32 inputs read once
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
    }))


if __name__ == "__main__":
    main()
