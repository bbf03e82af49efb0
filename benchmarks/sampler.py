"""Sampler throughput on SmolLM2-135M-Instruct next to transformers `generate`, measured in one run.

    python benchmarks/sampler.py [--batch 32] [--new-tokens 128] [--dtypes float32,bfloat16] [--repeats 2]

Prints one JSON line: generated tokens/s of drgrpo_jax.sampler.generate.generate (per dtype; steady state
after a compile call), of transformers' `generate` (PyTorch CPU, float32 and each --dtypes) on the
same weights, batch and lengths, the ratios (`ratio_X`: ours in X over transformers in float32, its
CPU default; `ratio_X_vs_transformers_X`: the same dtype on both sides), the compile time, and the
time `/update_weights_from_disk` takes to swap in a checkpoint (load + checks + swap). Every row
samples exactly --new-tokens tokens (EOS ignored in both) at temperature 1 with top-k/top-p off,
from left-padded prompts of 48-64 random token ids.
With both dtypes, it also reports how far bfloat16 greedy decoding agrees with float32 on that batch,
and the machine's load average before and after (the machine is shared: compare within one run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, batch_bucket, bucket, make_batch
from drgrpo_jax.sampler.generate import generate

from _common import sampler_prompts, smollm2_gguf, time_transformers


def time_ours(model, rows_prompts, new_tokens: int, dtype, repeats: int) -> dict:
    """Compile + steady-state timing of one bucketed generate call."""
    call = sampler_call(model, rows_prompts, new_tokens, dtype, temperature=1.0)
    start = time.perf_counter()
    out = call(0)
    first = time.perf_counter() - start
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        out = call(r + 1)
        times.append(time.perf_counter() - start)
    generated = int(np.asarray(out.lengths_B).sum())
    steady = float(np.median(times))
    return {"tokens_per_s": generated / steady, "seconds": steady, "generated_tokens": generated,
            "first_call_s": first, "compile_s": first - steady, "decode_steps": int(out.num_steps)}


def sampler_call(model, rows_prompts, new_tokens: int, dtype, temperature: float):
    """A function of a seed offset that runs one bucketed generate call over `rows_prompts` to completion."""
    graphdef, state = nnx.split(model)
    rows = [RowRequest(tuple(p), SamplingParams(max_new_tokens=new_tokens, temperature=temperature,
                                                ignore_eos=True), seed=i) for i, p in enumerate(rows_prompts)]

    def call(seed_offset: int):
        batch = make_batch([RowRequest(r.prompt_ids, r.params, r.seed + seed_offset) for r in rows],
                           model.config.eos_token_ids, batch_size=batch_bucket(len(rows)),
                           prompt_len=bucket(max(len(p) for p in rows_prompts)))
        out = generate(graphdef, state, batch, max_new_tokens=bucket(new_tokens),
                       cache_dtype=dtype)
        return jax.block_until_ready(out)

    return call


def greedy_agreement(models: dict, rows_prompts, new_tokens: int) -> dict:
    """How far bfloat16 greedy continuations follow float32's: matching positions and common prefixes."""
    tokens = {name: np.asarray(sampler_call(m, rows_prompts, new_tokens, dtype, temperature=0.0)(0).tokens_BT)
              [:len(rows_prompts), :new_tokens] for name, (m, dtype) in models.items()}
    same_BT = tokens["float32"] == tokens["bfloat16"]
    prefix_B = np.where(same_BT.all(axis=1), new_tokens, np.argmin(same_BT, axis=1))
    return {"token_match": float(same_BT.mean()), "mean_common_prefix": float(prefix_B.mean()),
            "min_common_prefix": int(prefix_B.min()), "rows_identical": float(same_BT.all(axis=1).mean())}


def time_weight_swap(folder: str, dtype: str) -> float:
    """Seconds for ServedWeights.load_folder (what /update_weights_from_disk runs) with a saved checkpoint."""
    from drgrpo_jax.config.serve import ServeConfig
    from drgrpo_jax.serve.weight_swap import ServedWeights

    served = ServedWeights(ServeConfig(model=folder, dtype=dtype), None)
    start = time.perf_counter()
    served.load_folder(folder, "1")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    gguf_path = smollm2_gguf()
    model = from_pretrained(gguf_path, dtype=jnp.float32)
    batch_prompts = sampler_prompts(args.batch, model.config.vocab_size)
    result: dict = {"benchmark": "sampler", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
                    "batch": args.batch, "prompt_tokens": [min(map(len, batch_prompts)), max(map(len, batch_prompts))],
                    "new_tokens": args.new_tokens, "temperature": 1.0, "machine": platform.processor() or
                    platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "load_average_before": os.getloadavg()[0]}
    models = {}
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(model, folder)  # the trainer's export format; transformers reads the same weights
        for name in args.dtypes.split(","):
            dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
            typed = model if name == "float32" else from_pretrained(folder, dtype=dtype)
            models[name] = (typed, dtype)
            result[f"ours_{name}"] = time_ours(typed, batch_prompts, args.new_tokens, dtype, args.repeats)
            result[f"weight_swap_s_{name}"] = time_weight_swap(folder, name)
        if {"float32", "bfloat16"} <= models.keys():
            result["bfloat16_greedy_vs_float32"] = greedy_agreement(models, batch_prompts, args.new_tokens)
        if not args.skip_transformers:  # the ratios' baseline is transformers in float32, its CPU default
            for name in dict.fromkeys(["float32", *args.dtypes.split(",")]):
                result[f"transformers_{name}"] = time_transformers(folder, batch_prompts, args.new_tokens,
                                                                   args.repeats, name)
            for name in args.dtypes.split(","):
                ours = result[f"ours_{name}"]["tokens_per_s"]
                result[f"ratio_{name}"] = ours / result["transformers_float32"]["tokens_per_s"]
                if name != "float32":
                    same_dtype = result[f"transformers_{name}"]["tokens_per_s"]
                    result[f"ratio_{name}_vs_transformers_{name}"] = ours / same_dtype
    result["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
