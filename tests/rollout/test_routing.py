"""Prefix-affine routing over several services: a key's service is the same on every process and every call, keys
spread evenly, a failing service's keys move to the others (its own only, nothing lost) and come back after."""

import inspect
import json
import time

import httpx
import numpy as np
import pytest

from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.rollout.routing import by_key, evenly, ranking, route_key

URLS = ("http://a", "http://b", "http://c")


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, rng.integers(5, 60)).tolist() for _ in range(count)]


class FakeFleet:
    """Services that answer /generate with tokens that depend on (prompt's first id, seed, sample) alone and record
    which host got which prompt; a host in `down` refuses connections, one in `busy` answers 429."""

    def __init__(self):
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self.down: set[str] = set()
        self.busy: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        if host in self.busy:
            return httpx.Response(429, json={"error": {"message": "queue full"}})
        body = json.loads(request.content)
        items = []
        for prompt, params in zip(body["input_ids"], body["sampling_params"]):
            self.seen.append((host, tuple(prompt)))
            for j in range(params["n"]):
                ids = [prompt[0], params["sampling_seed"] % 1000, j]
                items.append({"output_ids": ids, "meta_info": {
                    "output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": {"type": "length"},
                    "weight_version": "0"}})
        return httpx.Response(200, json=items)

    def hosts_of(self, prompts) -> list[str]:
        """The host that sampled each prompt, last seen."""
        where = {prompt: host for host, prompt in self.seen}
        return [where[tuple(prompt)] for prompt in prompts]


def fleet_client(fleet: FakeFleet, urls=URLS, **kwargs) -> RolloutClient:
    return RolloutClient(list(urls), transport=httpx.MockTransport(fleet), backoff_s=0.0, vocab_size=1000,
                         **{"max_retries": 1, **kwargs})


def routed(client: RolloutClient, prompts, **kwargs):
    """G = 2 completions of each prompt, each routed by its own ids."""
    return client.generate(prompts, 2, max_new_tokens=3, seed=3, route_prefixes=prompts, **kwargs)


def test_a_key_picks_one_service_whatever_the_url_order_or_the_process():
    keys = [route_key(prompt) for prompt in random_prompts(50)]
    chosen = [URLS[ranking(key, URLS)[0]] for key in keys]
    reordered = URLS[::-1]
    assert [reordered[ranking(key, reordered)[0]] for key in keys] == chosen
    assert route_key([1, 2, 3]) == route_key(np.asarray([1, 2, 3], np.int32)) != route_key([1, 2, 4])
    # Two processes, each with its share of the prompts (and its own first_url), send each prompt where one does.
    prompts = random_prompts(12)
    fleet = FakeFleet()
    with fleet_client(fleet) as whole:
        routed(whole, prompts)
    alone = fleet.hosts_of(prompts)
    fleet.seen.clear()
    for process, (a, b) in enumerate([(0, 6), (6, 12)]):
        with fleet_client(fleet) as client:
            routed(client, prompts[a:b], prompt_offset=a, first_url=process)
    assert fleet.hosts_of(prompts) == alone and len(set(alone)) == 3


def test_keys_spread_evenly_over_the_services():
    """200 prompts' keys over 4 services: each gets within 25% of a quarter (rendezvous hashing is uniform)."""
    urls = [f"http://gen-{i}:30000" for i in range(4)]
    shares = by_key([route_key(prompt) for prompt in random_prompts(200)], urls, range(4))
    counts = [len(shares.get(u, [])) for u in range(4)]
    assert sum(counts) == 200 and all(abs(count - 50) <= 12.5 for count in counts), counts


def test_a_dead_services_keys_move_to_the_others_and_only_its_own():
    prompts = random_prompts(60)
    fleet = FakeFleet()
    with fleet_client(fleet) as client:
        alive = routed(client, prompts)
        before = fleet.hosts_of(prompts)
        fleet.seen.clear()
        fleet.down.add("b")
        failed_over = routed(client, prompts)
    after = fleet.hosts_of(prompts)
    np.testing.assert_array_equal(failed_over.response_ids, alive.response_ids)  # nothing lost, nothing reordered
    assert "b" not in after
    assert all(a == b for a, b in zip(before, after) if a != "b")  # the others' keys stay where their cache is
    moved = [a for a, b in zip(after, before) if b == "b"]
    assert {"a", "c"} == set(moved), moved  # spread by each key's next choice, not all onto one


def test_a_failed_service_rests_then_gets_its_keys_back():
    prompts = random_prompts(30)
    fleet = FakeFleet()
    with fleet_client(fleet, rest_s=2.0, max_retries=0) as client:
        routed(client, prompts)
        home = fleet.hosts_of(prompts)
        fleet.busy.add("b")  # queue full: b answers 429
        failed_at = time.monotonic()
        routed(client, prompts)
        fleet.busy.clear()
        fleet.seen.clear()
        routed(client, prompts)  # still resting: b is not asked, its keys stay with their next choice
        assert time.monotonic() - failed_at < 2.0 and "b" not in fleet.hosts_of(prompts)
        time.sleep(2.0)
        routed(client, prompts)
    assert fleet.hosts_of(prompts) == home and "b" in home


def test_a_failed_service_rests_30_seconds_by_default():
    assert inspect.signature(RolloutClient).parameters["rest_s"].default == 30.0


def test_a_resting_service_is_still_asked_when_no_other_is_left():
    fleet = FakeFleet()
    fleet.busy.add("b")
    prompts = random_prompts(8)
    with fleet_client(fleet, urls=("http://a", "http://b"), max_retries=0) as client:
        routed(client, prompts)  # b rests now
        fleet.busy.clear()
        fleet.down.add("a")
        assert routed(client, prompts).response_ids.shape == (16, 3)
        fleet.down.add("b")
        with pytest.raises(RolloutError, match="every generation service failed"):
            routed(client, prompts)
    assert set(fleet.hosts_of(prompts)) == {"b"}


def test_a_group_travels_whole_to_its_service_on_every_engine():
    """A prompt's G rows are never split over services: SGLang's one row per completion goes in one request."""
    fleet = FakeFleet()
    prompts = random_prompts(10)
    with fleet_client(fleet, engine="sglang") as client:
        client._ready.update(client.urls)  # the fake fleet has no /server_info to read
        sampled = client.generate(prompts, 4, max_new_tokens=3, seed=3, route_prefixes=prompts)
    assert sampled.response_ids.shape == (40, 3)
    hosts: dict[tuple[int, ...], set[str]] = {}
    for host, prompt in fleet.seen:
        hosts.setdefault(prompt, set()).add(host)
    assert len(fleet.seen) == 40 and all(len(h) == 1 for h in hosts.values())


def test_calls_without_keys_split_into_contiguous_shares_from_first_url():
    assert evenly(5, [0, 1, 2], 1) == {1: [0, 1], 2: [2], 0: [3, 4]}
    assert evenly(1, [0, 1], 0) == {0: [0]}  # a share for each prompt, from first_url on
    assert evenly(4, [2], 7) == {2: [0, 1, 2, 3]}
