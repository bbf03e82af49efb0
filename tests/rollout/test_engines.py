"""Inference engines behind one interface (issue 62): the config's engine names, its traits table and the client's
registry agree, and the config's rules and the client ask an engine's traits and methods, never its name."""

from __future__ import annotations

import dataclasses
import json
from typing import get_args, get_type_hints

import httpx
import numpy as np
import pytest

from drgrpo_jax.config.engines import ENGINE_TRAITS, EngineName
from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.schema import RolloutConfig
from drgrpo_jax.errors import ConfigError, RolloutError
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.rollout.engines import ENGINES
from drgrpo_jax.rollout.engines.base import Call, Engine, read_sglang_items

INFLIGHT = ["rollout.async=true", "rollout.max_staleness=2", "algorithm.tis_cap=2.0", "rollout.inflight_updates=true"]


def test_the_config_offers_exactly_the_engines_the_client_drives():
    offered = get_args(get_type_hints(RolloutConfig)["engine"])
    assert offered == get_args(EngineName) == tuple(ENGINE_TRAITS) == tuple(ENGINES)
    assert all(engine.name == name and engine.traits is ENGINE_TRAITS[name] for name, engine in ENGINES.items())


@pytest.mark.parametrize("engine, trait, overrides, key", [
    ("vllm", "starts_locally", [], "rollout.engine"),
    ("vllm", "loads_lora_adapters", ["rollout.urls=[http://a]", "model.lora.rank=4"], "model.lora.push"),
    ("sglang", "inflight_updates", ["rollout.urls=[http://a]", *INFLIGHT], "rollout.inflight_updates"),
])
def test_the_rules_ask_the_engines_traits(engine, trait, overrides, key, monkeypatch):
    overrides = ["model.path=m", f"rollout.engine={engine}", *overrides]
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert error.value.key == key
    monkeypatch.setitem(ENGINE_TRAITS, engine, dataclasses.replace(ENGINE_TRAITS[engine], **{trait: True}))
    assert load_config(None, overrides).rollout.engine == engine  # the same engine, given the trait, passes


class ToyEngine(Engine):
    """An invented wire: one /sample call per prompt answered {"rows": [ids, ...]}, weights loaded by /load."""

    name = "ours"  # takes ours' place in the registry for these tests

    def generate_calls(self, prompts, seeds, shares, group_size, sampling):
        return [Call(k, "/sample", {"prompt": list(prompts[i]), "seed": int(seeds[i]), "n": group_size}, (i,))
                for k, share in enumerate(shares) for i in share]

    def read_completions(self, answer, group_size, vocab_size):
        return read_sglang_items([{"output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": "stop", "weight_version": "3"}}
            for ids in answer["rows"]], vocab_size)

    def push_weights(self, url, model_path, version, rollback, request):
        request("POST", url, "/load", {"path": model_path, "version": version})


def toy_server(log: list):
    """Answers /sample with n rows (prompt's first id, copy index) and records every call as (url, path, body)."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log.append((f"{request.url.scheme}://{request.url.host}", request.url.path, body))
        if request.url.path == "/sample":
            return httpx.Response(200, json={"rows": [[body["prompt"][0], g] for g in range(body["n"])]})
        return httpx.Response(200, json={})

    return handler


def test_the_client_drives_a_new_engine_through_the_interface_alone(monkeypatch):
    monkeypatch.setitem(ENGINES, "ours", ToyEngine())
    log: list = []
    with RolloutClient(["http://a", "http://b"], transport=httpx.MockTransport(toy_server(log)),
                       backoff_s=0.0) as client:
        sampled = client.generate([[10], [20], [30], [40]], 2, max_new_tokens=4, seed=1, expected_version=3)
        client.update_weights("/w/v4", 4)
    np.testing.assert_array_equal(sampled.response_ids[:, :2], [[p, g] for p in (10, 20, 30, 40) for g in (0, 1)])
    assert sampled.weight_versions == ("3",) * 8 and not sampled.truncated.any()
    assert sorted((url, body["prompt"][0]) for url, path, body in log if path == "/sample") == [
        ("http://a", 10), ("http://a", 20), ("http://b", 30), ("http://b", 40)]  # each URL its share
    assert sorted((url, body["version"]) for url, path, body in log if path == "/load") == [
        ("http://a", "4"), ("http://b", "4")]


def test_model_info_is_refused_without_a_request_where_the_engine_has_no_route():
    log: list = []
    with RolloutClient(["http://a"], transport=httpx.MockTransport(toy_server(log)), engine="vllm") as client:
        with pytest.raises(RolloutError, match="http://a: vLLM has no /get_model_info"):
            client.model_info()
    assert log == []
