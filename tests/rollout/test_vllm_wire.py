"""rollout.engine=vllm without vLLM: the client's requests and its reading of vLLM's answers, replayed from a real
vLLM 0.32 CPU server's (vllm_wire.json, recorded by scripts/vllm/record_wire.py and trimmed to the fields read)."""

import copy
import json
import pathlib

import httpx
import numpy as np
import pytest

from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError, RolloutError, StaleWeightsError
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.seeds import prompt_seeds

WIRE = json.loads((pathlib.Path(__file__).parent / "vllm_wire.json").read_text())


def fake_vllm(wire=WIRE, log=None):
    """A handler answering as the recorded server: its routes, config and version, and for /inference/v1/generate
    the recorded answer with one choice per completion asked for (the recorded choices, repeated)."""
    held = {"weight_version": "default"}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        if log is not None:
            log.append((path, body))
        if path == "/openapi.json":
            return httpx.Response(200, json=wire["openapi"])
        if path == "/server_info":
            return httpx.Response(200, json=wire["server_info"])
        if path == "/weight_info":
            return httpx.Response(200, json=held)
        if path == "/update_weight_version":
            held["weight_version"] = body["new_version"]
        if path in ("/collective_rpc", "/update_weight_version"):
            push = next(p for p in wire["push"] if p["path"] == path)
            return httpx.Response(push["status"], content=push["answer"].encode())
        if path == "/inference/v1/generate":
            answer = copy.deepcopy(wire["generate"]["answer"])
            recorded = answer["choices"]
            answer["choices"] = [{**recorded[g % len(recorded)], "index": g}
                                 for g in range(body["sampling_params"]["n"])]
            return httpx.Response(200, json=answer)
        return httpx.Response(404, json={"detail": "Not Found"})
    return handler


def vllm_client(handler, urls=("http://a",)) -> RolloutClient:
    return RolloutClient(list(urls), transport=httpx.MockTransport(handler), backoff_s=0.0, engine="vllm")


def test_a_recorded_answer_becomes_the_completions_it_holds():
    recorded = WIRE["generate"]["answer"]["choices"]
    with vllm_client(fake_vllm()) as client:
        sampled = client.generate([[1, 5, 6, 7]], 2, max_new_tokens=8, temperature=0.7)
    for g, choice in enumerate(recorded):
        ids = choice["token_ids"]
        np.testing.assert_array_equal(sampled.response_ids[g], ids + [0] * (8 - len(ids)))
        np.testing.assert_allclose(sampled.behaviour_logprobs[g, :len(ids)],
                                   [entry["logprob"] for entry in choice["logprobs"]["content"]], rtol=1e-6)
    assert sampled.lengths.tolist() == [6, 6] and sampled.truncated.tolist() == [True, True]  # finish "length"
    assert sampled.weight_versions == ("default", "default")


def test_a_stop_token_ends_the_completion_and_stays_in_it():
    stopped = WIRE["generate_stop"]

    def handler(request):
        return httpx.Response(200, json=stopped["answer"]) if request.url.path.endswith("/generate") else \
            fake_vllm()(request)
    with vllm_client(handler) as client:
        sampled = client.generate([[1, 5, 6, 7]], 1, max_new_tokens=6, temperature=0.7, stop_token_ids=[9])
    assert sampled.response_ids[0].tolist() == [9, 0, 0, 0, 0, 0] and sampled.truncated.tolist() == [False]


def test_each_prompt_is_one_request_of_its_group_with_its_own_seed():
    """n = G completions per request, seeded by the prompt's seed (vLLM seeds completion g with seed + g, so the
    recorded group differs); the seeds follow the prompts' global indices as with the SGLang wire."""
    log = []
    prompts = [[1, 5], [1, 6, 7], [1, 8]]
    with vllm_client(fake_vllm(log=log), urls=("http://a", "http://b")) as client:
        client.generate(prompts, 2, max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[2],
                        seed=11, prompt_offset=4, ignore_eos=True)
    bodies = sorted((body for path, body in log if path == "/inference/v1/generate"), key=lambda b: b["token_ids"])
    assert [b["token_ids"] for b in bodies] == sorted(prompts)
    by_prompt = {tuple(b["token_ids"]): b["sampling_params"] for b in bodies}
    for prompt, seed in zip(prompts, prompt_seeds(11, 3, 4)):
        assert by_prompt[tuple(prompt)] == {**WIRE["generate"]["request"]["sampling_params"], "n": 2, "seed": seed,
                                            "max_tokens": 6, "top_p": 0.9, "top_k": 5, "stop_token_ids": [2],
                                            "ignore_eos": True}
    recorded = [choice["token_ids"] for choice in WIRE["generate"]["answer"]["choices"]]
    assert recorded[0] != recorded[1], "the recorded group of one request with one seed came back identical"


def test_a_completion_that_crossed_a_push_reports_its_first_version():
    wire = copy.deepcopy(WIRE)
    for choice in wire["generate"]["answer"]["choices"]:
        choice["weight_versions"] = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 6}]
    with vllm_client(fake_vllm(wire)) as client, pytest.raises(StaleWeightsError, match="got '1', expected '2'"):
        client.generate([[1, 5]], 2, max_new_tokens=6, expected_version=2)


@pytest.mark.parametrize("route, fix", [("/inference/v1/generate", "--enable-scale-out"),
                                        ("/collective_rpc", "VLLM_SERVER_DEV_MODE=1"),
                                        ("/update_weight_version", "VLLM_SERVER_DEV_MODE=1")])
def test_a_server_without_a_route_is_refused_naming_the_flag(route, fix):
    wire = copy.deepcopy(WIRE)
    del wire["openapi"]["paths"][route]
    with vllm_client(fake_vllm(wire)) as client, pytest.raises(ConfigError) as info:
        client.generate([[1, 5]], 2, max_new_tokens=6)
    message = str(info.value)
    assert message.startswith("rollout.engine: vllm: http://a ") and fix in message and "\n" not in message


def test_log_probs_before_temperature_are_refused_naming_the_flag():
    wire = copy.deepcopy(WIRE)
    wire["server_info"]["vllm_config"]["model_config"]["logprobs_mode"] = "raw_logprobs"
    with vllm_client(fake_vllm(wire)) as client, pytest.raises(ConfigError, match="--logprobs-mode processed_"):
        client.update_weights("/w/v1", 1)


def test_the_push_reloads_the_folder_then_labels_it_and_never_goes_back():
    log = []
    with vllm_client(fake_vllm(log=log)) as client:
        client.update_weights("/w/v3", 3)
        pushes = [(path, body) for path, body in log if path in ("/collective_rpc", "/update_weight_version")]
        assert pushes == [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w/v3"}}),
                          ("/update_weight_version", {"new_version": "3"})]
        with pytest.raises(RolloutError, match="weight version 2 is older than the 3 it holds"):
            client.update_weights("/w/v2", 2)
        assert len([p for p, _ in log if p == "/collective_rpc"]) == 1  # refused before anything was sent
        client.update_weights("/w/v2", 2, rollback=True)  # a resumed run may go back
        with pytest.raises(RolloutError, match="not a bucket"):
            client.update_weights("gs://bucket/w/v4", 4)


def test_the_engine_key_is_checked():
    assert load_config(None, ["model.path=m"]).rollout.engine == "ours"
    with pytest.raises(ConfigError, match="rollout.engine: vllm is the API of the services at rollout.urls"):
        load_config(None, ["model.path=m", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="model.lora.push: adapter: vLLM reloads whole models"):
        load_config(None, ["model.path=m", "rollout.engine=vllm", "rollout.urls=[http://a]", "model.lora.rank=4"])
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, ["model.path=m", "rollout.engine=tgi", "rollout.urls=[http://a]"])
    with pytest.raises(ValueError, match="engine: 'tgi' is not one of ours, sglang, vllm"):
        RolloutClient(["http://a"], engine="tgi")  # type: ignore[arg-type]
