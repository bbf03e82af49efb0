"""/generate's `return_routed_experts` (SGLang's field): a mixture of experts answers with the experts every layer
chose for each token it read, the same ones the sampler recorded and that router replay feeds the trainer; a dense
model refuses the field in one line."""

import base64

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from flax import nnx

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler

from support.tiny_models import write_tiny_llama, write_tiny_qwen3_moe

PROMPTS = [[1, 7, 12, 30, 4], [1, 22, 40]]


def _client(folder: str) -> TestClient:
    scheduler = Scheduler(ServeConfig(model=folder, short_request_tokens=0, batch_wait_ms=1.0))
    return TestClient(build_app(scheduler), base_url="http://localhost")


@pytest.mark.heavy
def test_a_mixture_returns_the_experts_of_every_token_it_read(tmp_path):
    folder = write_tiny_qwen3_moe(str(tmp_path / "moe"))
    model = from_pretrained(folder)
    L, k = model.config.num_layers, model.config.experts_per_token
    with _client(folder) as client:
        body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                "return_logprob": True, "return_routed_experts": True}
        answers = client.post("/generate", json=body).json()
        plain = client.post("/generate", json={**body, "return_routed_experts": False}).json()
    for prompt, answer, without in zip(PROMPTS, answers, plain):
        ids = answer["output_ids"]
        assert ids == without["output_ids"] and "routed_experts" not in without["meta_info"]
        experts = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), "<i4")
        experts = experts.reshape(len(prompt) + len(ids) - 1, L, k)
        # The router's own choice over the same tokens (the last one is never read), from a cached decode.
        read = np.asarray(prompt + ids[:-1])[None]
        _, _, chosen = nnx.jit(lambda m, x: m.decode_routed(x, np.arange(x.shape[1])[None],
                                                            init_cache(m.config, 1, x.shape[1])))(model, read)
        np.testing.assert_array_equal(np.sort(experts, -1), np.sort(np.asarray(jax.device_get(chosen))[0], -1))


def test_a_dense_model_refuses_the_field(tmp_path):
    with _client(write_tiny_llama(str(tmp_path / "dense"))) as client:
        answer = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4},
                                                "return_routed_experts": True})
    assert answer.status_code == 400
    assert "return_routed_experts: the served llama model has no router" in answer.text
