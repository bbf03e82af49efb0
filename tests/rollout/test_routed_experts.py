"""Router replay from the service to the batch: the client decodes each completion's routed experts (SGLang's
base64 int32, or vLLM's .npy translated to it) and refuses a wrong one naming the completion; the record lays them
out as the batch's tokens; and, end to end, a tiny Qwen3-MoE served in-process samples a completion whose float32
trainer log-probs under replay equal the service's behaviour log-probs to 1e-5."""

import base64
import copy
import io
import json

import httpx
import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from flax import nnx
from test_vllm_wire import WIRE, fake_vllm, vllm_client

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.errors import ConfigError, RolloutError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.rollout.client import RolloutClient, RouterShape
from drgrpo_jax.rollout.record import ScoredRollout, routed_layout
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.policy import policy_logprobs

from support.tiny_models import write_tiny_qwen3_moe

SHAPE = RouterShape(layers=2, experts_per_token=2, num_experts=8)


def _b64(values) -> str:
    return base64.b64encode(np.asarray(values, "<i4").tobytes()).decode("ascii")


def _answer(prompt_len: int, ids: list[int], experts=None) -> dict:
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": {"type": "length"},
            "weight_version": "0"}
    if experts is not False:
        experts = np.arange((prompt_len + len(ids) - 1) * 4).reshape(-1, 2, 2) % 8 if experts is None else experts
        meta["routed_experts"] = experts if isinstance(experts, str) else _b64(experts)
    return {"output_ids": ids, "meta_info": meta}


def _client(answers: list[dict], log: list | None = None) -> RolloutClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if log is not None:
            log.append(json.loads(request.content))
        return httpx.Response(200, json=answers)
    return RolloutClient(["http://a"], transport=httpx.MockTransport(handler), backoff_s=0.0, vocab_size=100)


def test_the_routed_experts_are_asked_for_and_decoded_per_completion():
    log: list = []
    answers = [_answer(3, [5, 6, 7]), _answer(3, [8])]
    with _client(answers, log) as client:
        sampled = client.generate([[1, 2, 3]], 2, max_new_tokens=4, return_routed_experts=SHAPE)
        plain = _client(answers, log).generate([[1, 2, 3]], 2, max_new_tokens=4)
    assert log[0]["return_routed_experts"] is True and "return_routed_experts" not in log[1]
    assert plain.routed_experts is None
    assert [e.shape for e in sampled.routed_experts] == [(5, 2, 2), (3, 2, 2)]
    for experts, answer in zip(sampled.routed_experts, answers):
        assert experts.dtype == np.int32
        assert _b64(experts) == answer["meta_info"]["routed_experts"]


@pytest.mark.parametrize("experts, fragment", [
    (False, "no meta_info.routed_experts"),
    ("not base64!", "not base64 of int32"),
    (np.zeros((4, 2, 2)), "holds 16 ids, not the 5 tokens read (prompt 3 + completion 3 - 1) x 2 layers x 2 experts"),
    (np.zeros((5, 2, 1)), "holds 10 ids"),
    (np.full((5, 2, 2), 8), "expert ids in [8, 8], outside the model's [0, 8)"),
    (np.full((5, 2, 2), -1), "outside the model's [0, 8)"),
])
def test_a_wrong_routed_experts_answer_names_the_completion(experts, fragment):
    answers = [_answer(3, [5, 6]), _answer(3, [5, 6, 7], experts)]
    with _client(answers) as client, pytest.raises(RolloutError) as info:
        client.generate([[1, 2, 3]], 2, max_new_tokens=4, return_routed_experts=SHAPE)
    assert str(info.value).startswith("http://a/generate: completion 1: ") and fragment in str(info.value), \
        str(info.value)


def _npy(array) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_vllm_returns_routed_experts_only_when_started_to():
    """vLLM answers each choice's experts as a base64 .npy (uint8 here) when started with
    --enable-return-routed-experts; the client reads them as SGLang's, and refuses a server without the flag."""
    wire = copy.deepcopy(WIRE)
    choices = wire["generate"]["answer"]["choices"]
    read = [np.arange((4 + len(c["token_ids"]) - 1) * 4, dtype=np.uint8).reshape(-1, 2, 2) % 8 for c in choices]
    for choice, experts in zip(choices, read):
        choice["routed_experts"] = _npy(experts)
    with vllm_client(fake_vllm(wire)) as client, pytest.raises(ConfigError) as info:
        client.generate([[1, 5, 6, 7]], 2, max_new_tokens=8, return_routed_experts=SHAPE)
    assert info.value.key == "model.moe.router_replay" and "--enable-return-routed-experts" in str(info.value)
    wire["server_info"]["vllm_config"]["aux_output_config"] = {"enable_return_routed_experts": True}
    with vllm_client(fake_vllm(wire)) as client:
        sampled = client.generate([[1, 5, 6, 7]], 2, max_new_tokens=8, return_routed_experts=SHAPE)
    for got, sent in zip(sampled.routed_experts, read):
        np.testing.assert_array_equal(got, sent)
    choices[0]["routed_experts"] = "AAAA"
    with vllm_client(fake_vllm(wire)) as client, pytest.raises(RolloutError, match="not a base64 .npy array"):
        client.generate([[1, 5, 6, 7]], 2, max_new_tokens=8, return_routed_experts=SHAPE)


def test_the_layout_puts_each_tokens_experts_where_the_batch_reads_that_token():
    """Row n's experts of its i-th read token land where prompt_ids ++ response_ids hold that token: the prompt's
    left-padded to U, the response's from U on; the last response token (never read) and padding hold 0."""
    prompts, lengths, U, T = [(1, 7, 12), (1, 22, 40, 41, 9)], [3, 1], 6, 4
    read = [np.arange(1, len(p) + n)[:, None, None] * np.ones((1, 2, 2), int) + 100 * r
            for r, (p, n) in enumerate(zip(prompts, lengths))]
    rollout = ScoredRollout.from_prompts(
        [Example(str(i), "q", "a") for i in range(2)], prompts, response_ids=np.ones((2, T), np.int32),
        behaviour_logprobs=np.zeros((2, T), np.float32), response_mask=np.arange(T) < np.c_[lengths],
        lengths=np.asarray(lengths, np.int32), truncated=np.zeros(2, bool), weight_versions=np.zeros(2, np.int64),
        components=np.zeros((2, 1), np.float32), routed_experts=routed_layout(read, [3, 5], U, T))
    batch = rollout.take([1, 0]).to_batch(np.zeros(2, np.float32), U)  # take: the field follows its rows
    tokens = np.concatenate([batch.prompt_ids, batch.response_ids], axis=1)
    real = np.concatenate([batch.prompt_mask, batch.response_mask], axis=1)
    for n, (r, prompt) in enumerate([(1, prompts[1]), (0, prompts[0])]):
        positions = np.flatnonzero(real[n])[:-1]  # every real token but the last is read
        assert tokens[n, positions[:len(prompt)]].tolist() == list(prompt)
        expected = 100 * r + np.arange(1, len(positions) + 1)
        np.testing.assert_array_equal(batch.routed_experts[n, positions, 0, 0], expected)
        assert not np.delete(batch.routed_experts[n], positions, axis=0).any()
    assert batch.routed_experts.shape == (2, U + T, 2, 2) and batch.routed_experts.dtype == np.int32
    with pytest.raises(ValueError, match="routed_experts: 10 positions, not prompt_length 5"):
        rollout.to_batch(np.zeros(2, np.float32), 5)
    assert rollout.row_arrays()["routed_experts"] is rollout.routed_experts


@pytest.mark.heavy  # an in-process service and the policy's forward
def test_replayed_trainer_logprobs_equal_the_services_behaviour_logprobs(tmp_path):
    """The service samples (temperature 1) and returns the experts; the record lays them out; the trainer's float32
    forward with them gives the behaviour log-probs to 1e-5."""
    folder = write_tiny_qwen3_moe(str(tmp_path / "moe"))
    model = from_pretrained(folder)
    shape = RouterShape(model.config.num_layers, model.config.experts_per_token, model.config.num_experts)
    prompts, group, U, T = [[1, 7, 12, 30, 4], [1, 22], [1, 40, 41, 9, 9, 9, 3, 17, 25]], 2, 12, 10
    scheduler = Scheduler(ServeConfig(model=folder, short_request_tokens=0, batch_wait_ms=1.0))
    with TestClient(build_app(scheduler), base_url="http://localhost") as http:
        def forward(request: httpx.Request) -> httpx.Response:
            answer = http.request(request.method, request.url.path, content=request.content,
                                  headers={"content-type": "application/json"})
            return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)
        with RolloutClient(["http://localhost"], transport=httpx.MockTransport(forward)) as client:
            sampled = client.generate(prompts, group, max_new_tokens=T, temperature=1.0, seed=5,
                                      stop_token_ids=[2], return_routed_experts=shape)
    scheduler.close()
    rollout = ScoredRollout.from_prompts(
        [Example(str(i), "q", "a") for i in range(len(prompts))], prompts, response_ids=sampled.response_ids,
        behaviour_logprobs=sampled.behaviour_logprobs, response_mask=sampled.response_mask, lengths=sampled.lengths,
        truncated=sampled.truncated, weight_versions=np.zeros(len(sampled.lengths), np.int64),
        components=np.zeros((len(sampled.lengths), 1), np.float32),
        routed_experts=routed_layout(sampled.routed_experts, [len(prompts[n // group]) for n in range(6)], U, T))
    batch = rollout.to_batch(np.zeros(6, np.float32), U)
    graphdef, params = nnx.split(model, nnx.Param)
    config = StepConfig(loss=LossConfig(budget=T), logprob_chunk=5)
    replayed = np.asarray(jax.jit(lambda p, b: policy_logprobs(graphdef, config, p, b))(params, batch))
    mask = batch.response_mask
    assert mask.sum() >= 30
    np.testing.assert_allclose(replayed[mask], batch.behaviour_logprobs[mask], atol=1e-5, rtol=0)
