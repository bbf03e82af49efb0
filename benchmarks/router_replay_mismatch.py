"""How far the trainer's bfloat16 log-probs of sampled completions are from the service's, with and without router
replay (model.moe.router_replay), on a small random Qwen3-MoE.

    pip install -e '.[train]'
    python benchmarks/router_replay_mismatch.py [--dtype bfloat16] [--prompts 8] [--group 4] [--new-tokens 32]
                                                [--seed 0]

Our generation service (in-process, `--dtype`) samples completions at temperature 1 and returns each token's
log-prob and the experts its router chose at every layer; the record lays them out as the batch
(`Batch.routed_experts`). The trainer's forward (`step.policy.policy_logprobs`, in `--dtype`) computes the
completions' log-probs twice: replaying those experts and routing by itself. Prints one JSON line: per mode the
mean and max |trainer - behaviour| over the completions' tokens, and the share of the tokens read (prompt and
completion) whose expert set differs at some layer between the service and the trainer's own routing (a one-pass
forward of each row, `Transformer.decode_routed`), and the share of (token, layer) pairs that differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
from fastapi.testclient import TestClient
from flax import nnx

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.rollout.client import RolloutClient, RouterShape
from drgrpo_jax.rollout.record import ScoredRollout, routed_layout
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.policy import policy_logprobs

# A small Qwen3-MoE: 4 layers of 8 experts (hidden 64), 2 per token, renormalised weights.
CONFIG = DecoderConfig(family="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256, num_experts=8,
                       experts_per_token=2, moe_intermediate_size=64, norm_topk_prob=True, bos_token_id=1,
                       eos_token_ids=(2,), pad_token_id=0)


def sample(folder: str, dtype: str, prompts: list[list[int]], group: int, new_tokens: int, seed: int):
    """The service's completions of `prompts` (temperature 1), with their log-probs and routed experts."""
    shape = RouterShape(CONFIG.num_layers, CONFIG.experts_per_token, CONFIG.num_experts)
    scheduler = Scheduler(ServeConfig(model=folder, dtype=dtype, short_request_tokens=0, batch_wait_ms=1.0))
    try:
        with TestClient(build_app(scheduler), base_url="http://localhost") as http:
            def forward(request: httpx.Request) -> httpx.Response:
                answer = http.request(request.method, request.url.path, content=request.content,
                                      headers={"content-type": "application/json"})
                return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

            with RolloutClient(["http://localhost"], transport=httpx.MockTransport(forward)) as client:
                return client.generate(prompts, group, max_new_tokens=new_tokens, temperature=1.0, seed=seed,
                                       stop_token_ids=[2], return_routed_experts=shape)
    finally:
        scheduler.close()


def trainer_routing(model: Transformer, batch) -> np.ndarray:
    """The trainer's own experts [N, U + T, L, k] of each row, from one forward over prompt ++ response."""
    ids = np.concatenate([batch.prompt_ids, batch.response_ids], axis=1)
    real = np.concatenate([batch.prompt_mask, batch.response_mask], axis=1)
    positions = np.where(real, np.cumsum(real, axis=1) - 1, -1).astype(np.int32)
    cache = init_cache(model.config, ids.shape[0], ids.shape[1], jnp.dtype(model.embed[...].dtype))
    return np.asarray(model.decode_routed(jnp.asarray(ids), jnp.asarray(positions), cache)[2])


def routing_differs(served_NSLk: np.ndarray, trainer_NSLk: np.ndarray, read_NS: np.ndarray) -> dict[str, float]:
    """Shares of the read tokens, and of their (token, layer) pairs, whose expert sets differ."""
    differs_NSL = (np.sort(served_NSLk, -1) != np.sort(trainer_NSLk, -1)).any(-1)[read_NS]
    return {"routing_differs_token_share": round(float(differs_NSL.any(-1).mean()), 4),
            "routing_differs_pair_share": round(float(differs_NSL.mean()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    prompts = [[1, *rng.integers(3, CONFIG.vocab_size, int(rng.integers(4, 17))).tolist()]
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(Transformer(CONFIG, rngs=nnx.Rngs(args.seed)), folder)
        sampled = sample(folder, args.dtype, prompts, args.group, args.new_tokens, args.seed)
        model = from_pretrained(folder, dtype=jnp.dtype(args.dtype))
    N, U, T = len(sampled.lengths), max(map(len, prompts)), args.new_tokens
    prompt_lengths = [len(prompts[n // args.group]) for n in range(N)]
    rollout = ScoredRollout.from_prompts(
        [Example(str(i), "q", "a") for i in range(len(prompts))], prompts, response_ids=sampled.response_ids,
        behaviour_logprobs=sampled.behaviour_logprobs, response_mask=sampled.response_mask, lengths=sampled.lengths,
        truncated=sampled.truncated, weight_versions=np.zeros(N, np.int64), components=np.zeros((N, 1), np.float32),
        routed_experts=routed_layout(sampled.routed_experts, prompt_lengths, U, T))
    batch = rollout.to_batch(np.zeros(N, np.float32), U)
    graphdef, params = nnx.split(model, nnx.Param)
    config = StepConfig(loss=LossConfig(budget=T), compute_dtype=args.dtype)
    logprobs = jax.jit(lambda p, b: policy_logprobs(graphdef, config, p, b))
    mask = batch.response_mask
    read = np.concatenate([batch.prompt_mask, batch.response_mask], axis=1)
    read[np.arange(N), U + batch.response_mask.sum(1) - 1] = False  # the last token is never read
    out: dict = {"benchmark": "router_replay_mismatch", "model": "random qwen3_moe", "dtype": args.dtype,
                 "experts": CONFIG.num_experts, "experts_per_token": CONFIG.experts_per_token,
                 "layers": CONFIG.num_layers, "completions": N, "completion_tokens": int(mask.sum())}
    for mode, replay in (("replay", batch), ("no_replay", dataclasses.replace(batch, routed_experts=None))):
        diff = np.abs(np.asarray(logprobs(params, replay), np.float32) - batch.behaviour_logprobs)[mask]
        out[mode] = {"logprob_absdiff_mean": float(f"{diff.mean():.3g}"), "logprob_absdiff_max": float(
            f"{diff.max():.3g}")}
    out["no_replay"].update(routing_differs(batch.routed_experts, trainer_routing(model, batch), read))
    out["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
