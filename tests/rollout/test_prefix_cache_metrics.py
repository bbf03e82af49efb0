"""The services' prefix caches in the step's metrics: read from each native service's /get_model_info after a
round, as the round's growth of its counts summed over the services; no `prefix_cache` there, no metrics."""

import json

import httpx
import numpy as np
import pytest

from drgrpo_jax.actor.actor import Actor, GroupSampling
from drgrpo_jax.data.examples import Example
from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rewards.functions import RewardResult
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.rollout.engines.base import PrefixCacheStats, read_prefix_cache
from drgrpo_jax.rollout.record import HostCounters

HIT_RATE = "rollout/prefix_cache_hit_rate"


def cache(hit=0, miss=0, evicted=0, cached=0, budget=1 << 20) -> dict[str, int]:
    return {"hit_tokens": hit, "miss_tokens": miss, "evicted_blocks": evicted, "cached_blocks": cached,
            "budget_bytes": budget}


class Services:
    """Fake services: /get_model_info reports `reports[host]` as prefix_cache (absent when None), /generate answers
    one token per completion; every request is recorded as (host, path)."""

    def __init__(self, reports: dict[str, dict | None]):
        self.reports = reports
        self.asked: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.asked.append((host, path))
        if path == "/get_model_info":
            report = self.reports[host]
            return httpx.Response(200, json={"vocab_size": 100, **({} if report is None else {"prefix_cache": report})})
        body = json.loads(request.content)
        return httpx.Response(200, json=[
            {"output_ids": [5], "meta_info": {"output_token_logprobs": [[-0.1, 5, None]],
                                              "finish_reason": {"type": "stop"}, "weight_version": "0"}}
            for params in body["sampling_params"] for _ in range(params["n"])])


def client_of(services: Services, engine="ours") -> RolloutClient:
    return RolloutClient([f"http://{host}" for host in services.reports], transport=httpx.MockTransport(services),
                         backoff_s=0.0, vocab_size=100, engine=engine)


def test_a_round_reads_the_growth_of_every_services_counts():
    services = Services({"a": cache(hit=100, miss=50, evicted=1, cached=4), "b": cache(hit=0, miss=10, cached=1)})
    with client_of(services) as client:
        first = client.prefix_cache_delta()  # since the services started
        services.reports["a"] = cache(hit=400, miss=70, evicted=3, cached=6)
        services.reports["b"] = cache(hit=20, miss=10, cached=2)
        second = client.prefix_cache_delta()
        services.reports["b"] = cache(hit=5, miss=1)  # b restarted: its counts start again from zero
        third = client.prefix_cache_delta()
    assert first == PrefixCacheStats(100, 60, 1, 5, 2 << 20)
    assert second == PrefixCacheStats(320, 20, 2, 8, 2 << 20)
    assert third == PrefixCacheStats(5, 1, 0, 6, 2 << 20)
    rate = HostCounters(("f",), 1.0, 1.0, np.zeros(1), np.zeros(1), prefix_cache=second).metrics()[HIT_RATE]
    assert rate == 320 / 340


def test_no_prefix_cache_no_metrics_and_no_error():
    services = Services({"a": None, "b": cache(budget=0)})  # none, and one turned off (no budget)
    with client_of(services) as client:
        assert client.prefix_cache_delta() is None
    assert HIT_RATE not in HostCounters(("f",), 1.0, 1.0, np.zeros(1), np.zeros(1)).metrics()
    other = Services({"a": cache(hit=1)})
    with client_of(other, engine="sglang") as client:  # an engine without the counters is not asked for them
        assert client.prefix_cache_delta() is None
    assert other.asked == []


def test_a_report_that_cannot_be_read_adds_nothing_and_warns(caplog):
    services = Services({"a": cache(hit=10, miss=10), "b": {**cache(), "hit_tokens": -3}})
    with client_of(services) as client:
        assert client.prefix_cache_delta() == PrefixCacheStats(10, 10, 0, 0, 1 << 20)
    assert "http://b/get_model_info: prefix_cache.hit_tokens: -3 is not a count" in caplog.text
    assert ("b", "/get_model_info") in services.asked and services.asked.count(("b", "/get_model_info")) == 1
    with pytest.raises(RolloutError, match="prefix_cache: a list, not an object"):
        read_prefix_cache([], "prefix_cache")
    asked = []

    def unavailable(request):
        asked.append(request.url.path)
        return httpx.Response(503)

    with RolloutClient(["http://a"], transport=httpx.MockTransport(unavailable), backoff_s=0.0, vocab_size=100,
                       max_retries=4) as client:
        assert client.prefix_cache_delta() is None
    assert asked == ["/get_model_info"]  # one request, not retried: the round's rows do not wait on a metric


def test_rounds_add_their_counts_and_keep_the_last_size():
    one = HostCounters(("f",), 1.0, 1.0, np.zeros(1), np.zeros(1), prefix_cache=PrefixCacheStats(3, 1, 2, 9, 64))
    two = HostCounters(("f",), 1.0, 1.0, np.zeros(1), np.zeros(1), prefix_cache=PrefixCacheStats(1, 3, 0, 7, 64))
    both = (one + two).metrics()
    assert both[HIT_RATE] == 0.5 and both["rollout/prefix_cache_evicted_blocks"] == 2
    assert both["rollout/prefix_cache_cached_blocks"] == 7 and both["rollout/prefix_cache_hit_tokens"] == 4
    assert both["rollout/prefix_cache_prefilled_tokens"] == 4
    stacked = {k: np.stack([one.arrays()[k], two.arrays()[k]]) for k in one.arrays()}
    assert one.across_hosts(stacked).prefix_cache == one.prefix_cache  # the fleet's, as this host read it


class Tokenizer:
    eos_token_id = 2

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["x"] * len(rows)


class Scorer:
    def score(self, texts, examples, lengths, given=None):
        return RewardResult(np.ones((len(texts), 1), np.float32), ("f",), (1.0,), ("f",), np.zeros(1, np.int64),
                            np.zeros(1, np.int64))


def test_the_actors_counters_carry_the_rounds_cache_metrics():
    services = Services({"a": cache(hit=0, miss=0)})
    actor = Actor(client_of(services), Scorer(), Tokenizer())
    examples = (Example("t/0", "q", "a"),)
    with actor.client:
        first = actor.sample_and_score(examples, [[1, 2, 3]], GroupSampling(group=2, max_new_tokens=2), seed=0)
        assert first.counters.metrics()[HIT_RATE] is None  # nothing prefilled yet: no rate
        services.reports["a"] = cache(hit=30, miss=10, evicted=1, cached=2)
        scored = actor.sample_and_score(examples, [[1, 2, 3]], GroupSampling(group=2, max_new_tokens=2), seed=0)
    metrics = scored.counters.metrics()
    assert metrics[HIT_RATE] == 0.75 and metrics["rollout/prefix_cache_evicted_blocks"] == 1
