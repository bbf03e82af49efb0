"""rollout.engine=sglang against a fake SGLang server: one request row per completion, each with its own seed
(SGLang copies a row's sampling_seed into all n copies of it), and a warning plus the run's metadata when the
server does not say it runs with --enable-deterministic-inference (then it ignores seeds)."""

import json
import logging

import httpx
import numpy as np
import pytest

from drgrpo_jax.config.load import load_config
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.seeds import completion_seeds, prompt_seeds
from drgrpo_jax.train import trackers
from drgrpo_jax.train.setup import run_metadata

PROMPTS = [[10, 1], [20, 2, 2], [30]]


def fake_sglang(info_routes: dict[str, dict], bodies: list | None = None):
    """SGLang's /generate as SGLang answers it (n copies of each row, in row order), each completion's tokens
    (prompt's first id, its row's seed mod 1000, copy index); `info_routes`: the server-info routes it has."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            info = info_routes.get(request.url.path)
            return httpx.Response(200, json=info) if info is not None else httpx.Response(404, json={"detail": "x"})
        body = json.loads(request.content)
        if bodies is not None:
            bodies.append(body)
        items = []
        for prompt, params in zip(body["input_ids"], body["sampling_params"]):
            for j in range(params["n"]):
                ids = [prompt[0], params["sampling_seed"] % 1000, j]
                items.append({"output_ids": ids, "meta_info": {
                    "output_token_logprobs": [[-0.5, t, None] for t in ids],
                    "finish_reason": {"type": "length", "length": 3}, "weight_version": "0"}})
        return httpx.Response(200, json=items)

    return handler


def sglang_client(handler, urls=("http://a",)) -> RolloutClient:
    return RolloutClient(list(urls), transport=httpx.MockTransport(handler), backoff_s=0.0, engine="sglang")


DETERMINISTIC = {"/server_info": {"enable_deterministic_inference": True, "random_seed": 1}}


@pytest.mark.parametrize("urls", [("http://a",), ("http://a", "http://b")])
def test_each_completion_is_its_own_row_with_its_own_seed_reassembled_prompt_major(urls):
    bodies: list = []
    with sglang_client(fake_sglang(DETERMINISTIC, bodies), urls) as client:
        sampled = client.generate(PROMPTS, 4, max_new_tokens=3, seed=5)
    bodies.sort(key=lambda body: PROMPTS.index(body["input_ids"][0]))  # the URLs' requests arrive in any order
    params = [p for body in bodies for p in body["sampling_params"]]
    rows = [row for body in bodies for row in body["input_ids"]]
    expected = [s for p in prompt_seeds(5, len(PROMPTS)) for s in completion_seeds(p, 4)]
    assert [p["sampling_seed"] for p in params] == expected and len(set(expected)) == 12
    assert {p["n"] for p in params} == {1} and rows == [p for p in PROMPTS for _ in range(4)]
    np.testing.assert_array_equal(sampled.response_ids[:, 0], np.repeat([10, 20, 30], 4))
    np.testing.assert_array_equal(sampled.response_ids[:, 1], np.array(expected) % 1000)
    assert sampled.group_size == 4 and sampled.response_ids.shape == (12, 3)


def test_engine_ours_still_sends_one_row_per_prompt_with_n():
    bodies: list = []
    handler = fake_sglang({}, bodies)
    with RolloutClient(["http://a"], transport=httpx.MockTransport(handler), backoff_s=0.0) as client:
        client.generate(PROMPTS, 4, max_new_tokens=3, seed=5)
    assert [(p["n"], p["sampling_seed"]) for p in bodies[0]["sampling_params"]] == \
        [(4, s) for s in prompt_seeds(5, len(PROMPTS))]
    assert client.seeds_ignored_by == ()


@pytest.mark.parametrize("routes, ignored", [
    ({"/server_info": {"enable_deterministic_inference": False}}, True),
    ({}, True),  # neither route: the server does not say, so its seeds are taken to be ignored
    ({"/server_info": {"random_seed": 3}}, True),  # no such field
    (DETERMINISTIC, False),
    ({"/get_server_info": {"enable_deterministic_inference": True}}, False),  # SGLang before /server_info
])
def test_a_server_that_ignores_seeds_is_named_once_and_recorded_in_the_metadata(routes, ignored, caplog):
    with caplog.at_level(logging.WARNING, "drgrpo_jax.rollout"), \
            sglang_client(fake_sglang(routes), ("http://a", "http://b")) as client:
        client.generate(PROMPTS, 2, max_new_tokens=3, seed=0)
        client.generate(PROMPTS, 2, max_new_tokens=3, seed=1)
    warnings = [r.getMessage() for r in caplog.records if "enable-deterministic-inference" in r.getMessage()]
    if ignored:
        assert client.seeds_ignored_by == ("http://a", "http://b")
        assert len(warnings) == 2 and "http://a" in warnings[0] and "http://b" in warnings[1]
        assert run_metadata(client) == {"rollout_seeds_honoured": False,
                                         "rollout_seeds_ignored_by": ["http://a", "http://b"]}
    else:
        assert client.seeds_ignored_by == () and warnings == [] and run_metadata(client) == {}


def test_the_trackers_get_the_metadata_beside_the_config(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(trackers, "TensorBoardTracker", lambda *args: opened.append(args))
    config = load_config(None, ["model.path=x", "run.report_to=[tensorboard]"])
    metadata = {"rollout_seeds_honoured": False, "rollout_seeds_ignored_by": ["http://a"]}
    trackers.open_trackers(config, str(tmp_path), 0, metadata)
    trackers.open_trackers(config, str(tmp_path), 0, {})
    (_, _, with_metadata), (_, _, without) = opened
    assert with_metadata.endswith("rollout_seeds_honoured: false\nrollout_seeds_ignored_by:\n- http://a\n")
    assert "rollout_seeds" not in without and with_metadata.startswith(without)
