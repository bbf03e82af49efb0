"""Context parallelism's memory: the compiled training step's per-device memory (XLA's `memory_analysis()`) for a
SmolLM2-135M-shaped model (random weights) on one row of --tokens tokens, with `mesh.context` = each of
--contexts on that many of 8 CPU devices, and with --time the step's tokens/s against context 1 (the 8 fake
devices share this machine's cores: a check that the split runs, not a speed-up figure).
Prints one JSON line: per context size, the temporaries (activations and the step's work buffers), arguments
(the state and the batch) and outputs in GB, the temporaries' share of context 1's, the plan's per-device
total (`python -m drgrpo_jax.plan`'s trainer figure) against the compiled one (arguments + outputs - aliased +
temporaries), and the compiled total against context 1's on one row of --baseline-tokens (the issue's goal: at
most 1 at context 8), whose own figures come last.
    python benchmarks/context_parallel.py [--tokens 32768] [--contexts 1,2,4,8] [--baseline-tokens 4096]
                                          [--remat full] [--time]
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402  (after XLA_FLAGS)
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from drgrpo_jax.config import load_config  # noqa: E402
from drgrpo_jax.losses import LossConfig  # noqa: E402
from drgrpo_jax.models.config import DecoderConfig, RuntimeOptions  # noqa: E402
from drgrpo_jax.models.transformer import Transformer  # noqa: E402
from drgrpo_jax.plan.planner import make_plan  # noqa: E402
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model  # noqa: E402
from drgrpo_jax.step.batch import Batch  # noqa: E402
from drgrpo_jax.step.config import StepConfig  # noqa: E402
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings  # noqa: E402

SMOLLM2_135M = DecoderConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                             max_position_embeddings=65536)
PROMPT = 64
GB = 1e9


def one_row(tokens: int) -> Batch:
    """One row: a 64-token prompt and a response filling the rest of the forward's `tokens` positions."""
    response = tokens - PROMPT + 1
    rng = np.random.default_rng(0)
    return Batch(prompt_ids=rng.integers(0, SMOLLM2_135M.vocab_size, (1, PROMPT)).astype(np.int32),
                 prompt_mask=np.ones((1, PROMPT), bool),
                 response_ids=rng.integers(0, SMOLLM2_135M.vocab_size, (1, response)).astype(np.int32),
                 response_mask=np.ones((1, response), bool), advantages=np.ones(1, np.float32),
                 old_logprobs=np.full((1, response), -10.0, np.float32),
                 behaviour_logprobs=np.full((1, response), -10.0, np.float32), row_valid=np.ones(1, bool))


def planned_bytes(context: int, tokens: int, remat: str) -> int:
    """The plan's per-device trainer total for the run `measure` compiles: one float32 row (a group of two in two
    micro-batches), its prompt and budget."""
    config = load_config(None, ["model.path=x", "model.dtype=float32", f"mesh.context={context}",
                                f"model.remat={remat}", "model.attention_impl=blockwise",
                                "rollout.prompts_per_step=1", "rollout.group_size=2", "train.micro_batches=2",
                                f"rollout.max_prompt_tokens={PROMPT}", f"rollout.max_new_tokens={tokens - PROMPT + 1}"])
    return make_plan(config, SMOLLM2_135M)["trainer"]["total"]


def measure(context: int, tokens: int, remat: str, timed: bool) -> dict:
    """The compiled step's memory on a context-way mesh, and the plan's (and its tokens/s with `timed`)."""
    mesh = make_mesh(MeshShape(data=1, fsdp=1, tensor=1, context=context), jax.devices()[:context])
    runtime = RuntimeOptions(remat=remat, attention_impl="blockwise")
    model = shard_model(Transformer(SMOLLM2_135M, rngs=nnx.Rngs(0), runtime=runtime), mesh)
    optimizer = optax.adamw(1e-6)
    graphdef, state = init_state(model, optimizer, jax.random.key(0))
    shardings = state_shardings(state, param_shardings(state.params, mesh), mesh)
    config = StepConfig(loss=LossConfig(budget=tokens - PROMPT + 1), on_policy=True)
    step = jit_train_step(graphdef, optimizer, optax.constant_schedule(1e-6), config, shardings, mesh)
    batch = place(one_row(tokens), batch_sharding(mesh))
    state = jax.device_put(state, shardings)
    compiled = step.lower(state, batch).compile()  # type: ignore[attr-defined]
    memory = compiled.memory_analysis()
    result = {"context": context, "temp_gb": round(memory.temp_size_in_bytes / GB, 3),
              "arguments_gb": round(memory.argument_size_in_bytes / GB, 3),
              "outputs_gb": round(memory.output_size_in_bytes / GB, 3)}
    compiled_total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                      + memory.temp_size_in_bytes)
    planned = planned_bytes(context, tokens, remat)
    result.update(total_gb=round(compiled_total / GB, 3), planned_total_gb=round(planned / GB, 3),
                  planned_over_compiled=round(planned / compiled_total, 3))
    if timed:
        state, _ = compiled(state, batch)  # warm-up
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        result["tokens_per_second"] = round(tokens / (time.perf_counter() - start), 1)
    del state, compiled  # the next context size's state takes its place
    jax.clear_caches()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--contexts", default="1,2,4,8")
    parser.add_argument("--baseline-tokens", type=int, default=4096)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--time", action="store_true")
    args = parser.parse_args()
    runs = [measure(int(c), args.tokens, args.remat, args.time) for c in args.contexts.split(",")]
    base = runs[0]["temp_gb"]
    for run in runs:
        run["temp_share_of_first"] = round(run["temp_gb"] / base, 3)
        if args.time:
            run["tokens_per_second_over_first"] = round(run["tokens_per_second"] / runs[0]["tokens_per_second"], 3)
    baseline = measure(1, args.baseline_tokens, args.remat, timed=False)
    for run in runs:
        run["total_over_baseline"] = round(run["total_gb"] / baseline["total_gb"], 3)
    print(json.dumps({"benchmark": "context_parallel", "model": "SmolLM2-135M-shaped (random)", "tokens": args.tokens,
                      "remat": args.remat, "backend": jax.default_backend(), "runs": runs,
                      "baseline": {"tokens": args.baseline_tokens, **baseline}}))


if __name__ == "__main__":
    main()
