"""The trainer against the real vLLM CPU server (rollout.engine=vllm): two steps, the weights pushed and versioned,
and a completion's behaviour log-probs equal to the trainer's float32 recomputation.

vLLM lives in its own virtual environment (`bash scripts/vllm/install_cpu.sh`); DRGRPO_VLLM_PYTHON names its
interpreter. Unset, the test skips with that reason, unless DRGRPO_REQUIRE_VLLM=1 (CI), where it fails.
"""

import contextlib
import json
import os
import socket
import subprocess
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from drgrpo_jax.errors import RolloutError
from drgrpo_jax.models.logprobs import sequence_logprobs
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.rollout.client import RolloutClient

from support.tiny_models import write_tiny_llama
from support.trainer_runs import start_trainer, trainer_overrides, write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # starts vLLM (about 90 s on 2 cores) and the trainer

VLLM_PYTHON = os.environ.get("DRGRPO_VLLM_PYTHON", "")
START_TIMEOUT_S = 600.0
TEMPERATURE = 0.7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """(URL, model folder) of a vLLM CPU server, started as docs/engines.md says, on a tiny Llama (head_dim 32:
    vLLM's CPU attention takes no smaller)."""
    if not VLLM_PYTHON:
        reason = "DRGRPO_VLLM_PYTHON is not set (bash scripts/vllm/install_cpu.sh, then .venv-vllm/bin/python)"
        if os.environ.get("DRGRPO_REQUIRE_VLLM") == "1":
            pytest.fail(f"DRGRPO_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
    model = write_tiny_llama(str(tmp_path_factory.mktemp("vllm") / "model"), hidden_size=128)
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm_log") / "vllm.log", "w+")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
         "--max-model-len", "128"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"vLLM did not start (exit {process.poll()}):\n{log.read()[-3000:]}")
            time.sleep(2)
        yield url, model
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(60)
        if process.poll() is None:
            process.kill()
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_two_steps_against_vllm_push_versions_and_match_the_trainers_logprobs(vllm_server, tmp_path):
    url, model = vllm_server
    out = tmp_path / "run"
    overrides = trainer_overrides(model, write_prompts(str(tmp_path / "prompts.jsonl"), 32), out, steps=2)
    process = start_trainer([*overrides, f"rollout.urls=[{url}]", "rollout.engine=vllm",
                             f"rollout.temperature={TEMPERATURE}", "model.compute_dtype=float32"])
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(abs(row["behaviour_kl"]) < 1e-6 for row in steps), [row["behaviour_kl"] for row in steps]
    # Version 0 at start, then one push after each step: the server holds the last.
    assert httpx.get(url + "/weight_info").json()["weight_version"] == "2"

    with RolloutClient([url], engine="vllm", timeout_s=120) as client:
        with pytest.raises(RolloutError, match="older than the 2 it holds"):
            client.update_weights(out / "weights" / "v1", 1)
        prompt = [1, 5, 6, 7]
        sampled = client.generate([prompt], 4, max_new_tokens=12, temperature=TEMPERATURE, seed=3,
                                  expected_version=2)
    assert len({tuple(row) for row in sampled.response_ids.tolist()}) > 1, "a group came back as one completion"

    ours = from_pretrained(str(out / "weights" / "v2"), dtype=jnp.float32)
    for row in range(sampled.response_ids.shape[0]):
        ids = [*prompt, *sampled.response_ids[row, :sampled.lengths[row]].tolist()]
        tokens = jnp.asarray([ids[:-1]], jnp.int32)
        logprobs, _ = sequence_logprobs(ours, tokens, jnp.asarray([ids[1:]], jnp.int32), temperature=TEMPERATURE)
        recomputed = np.asarray(logprobs[0, len(prompt) - 1:])
        np.testing.assert_allclose(sampled.behaviour_logprobs[row, :sampled.lengths[row]], recomputed, atol=1e-4)
