"""Over several services, every turn of an episode and every episode of a group reach the one service their opening
routes to (where its prefix is cached), and a service that dies mid-episode hands its episodes to the others."""

import json

import httpx

from drgrpo_jax.environments.protocol import Observation
from drgrpo_jax.environments.trajectory import EpisodeLimits, run_episodes
from drgrpo_jax.rollout.client import RolloutClient

URLS = ["http://a", "http://b", "http://c"]
OPENING = 500  # an opening's ids: OPENING + its example's number, then a shared few-shot block
FEW_SHOT = list(range(10, 40))


class Tokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class Renderer:
    """Openings of the example's id and a shared block; every environment turn is the same two tokens."""

    turn_stop_id = None

    def opening_ids(self, messages):
        return [OPENING + int(messages[0]["content"]), *FEW_SHOT]

    def continuation_ids(self, messages, model_stopped):
        return [7, 8]


class Talker:
    """An environment whose episode on example n lasts 1 + n % 3 turns, so the turns' calls hold fewer episodes."""

    tools = ()

    def reset(self, example):
        self.turns_left = 1 + example["number"] % 3
        return [{"role": "user", "content": str(example["number"])}]

    def step(self, text):
        self.turns_left -= 1
        return Observation(messages=[{"role": "user", "content": "go on"}], done=not self.turns_left)


class Fleet:
    """Services that answer each row with 3 tokens of its seed and record (host, row's opening id, row length)."""

    def __init__(self):
        self.seen: list[tuple[str, int, int]] = []
        self.down: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            raise httpx.ConnectError("refused", request=request)
        body = json.loads(request.content)
        items = []
        for prompt, params in zip(body["input_ids"], body["sampling_params"]):
            self.seen.append((request.url.host, prompt[0], len(prompt)))
            ids = [100 + params["sampling_seed"] % 100, 101, 102]
            items.append({"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                                           "finish_reason": {"type": "length"}, "weight_version": "0"}})
        return httpx.Response(200, json=items)

    def hosts_by_opening(self) -> dict[int, set[str]]:
        hosts: dict[int, set[str]] = {}
        for host, opening, _ in self.seen:
            hosts.setdefault(opening, set()).add(host)
        return hosts


def episodes(fleet: Fleet, groups: int, group_size: int = 4, max_turns: int = 4):
    examples = [{"number": p} for p in range(groups) for _ in range(group_size)]
    limits = EpisodeLimits(max_turns=max_turns, max_turn_tokens=3, max_model_tokens=60, max_total_tokens=100)
    with RolloutClient(URLS, transport=httpx.MockTransport(fleet), backoff_s=0.0, vocab_size=1000,
                       max_retries=0) as client:
        return run_episodes(client, Tokenizer(), Talker, examples, limits=limits, seed=5,
                            renderer=lambda env: Renderer())


def test_every_turn_of_a_groups_episodes_goes_to_one_service():
    fleet = Fleet()
    trajectories = episodes(fleet, groups=12)
    assert [t.turns for t in trajectories[::4]] == [1, 2, 3] * 4
    hosts = fleet.hosts_by_opening()
    assert len(fleet.seen) == 4 * (1 + 2 + 3) * 4 and len(hosts) == 12
    assert all(len(h) == 1 for h in hosts.values()), hosts  # every turn of all 4 episodes: one service
    assert {h for (h,) in hosts.values()} == {"a", "b", "c"}  # and the groups spread over the fleet


def test_a_service_that_dies_hands_its_episodes_to_the_others_and_nothing_is_lost():
    fleet = Fleet()
    alive = episodes(fleet, groups=12)
    home = {opening: next(iter(h)) for opening, h in fleet.hosts_by_opening().items()}
    fleet.seen.clear()
    fleet.down.add(home[OPENING])  # the first group's service is gone
    again = episodes(fleet, groups=12)
    assert [t.ids for t in again] == [t.ids for t in alive]
    moved = fleet.hosts_by_opening()
    assert all(len(h) == 1 for h in moved.values())  # each group still on one service, now another
    assert all(moved[o] == {home[o]} for o in home if home[o] != home[OPENING])
