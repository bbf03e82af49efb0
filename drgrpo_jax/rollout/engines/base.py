"""The interface every inference engine behind `rollout.urls` implements for the rollout client.

An engine turns one generate call into its own requests and its answers back into SGLang `/generate` items (so the
client checks and pads every engine's completions alike), reads a server's start-up settings, and pushes weights.
What it supports is its row of `config/engines.py` (`traits`). The client holds one engine and asks it; it never
compares names. Every method gets the client's `Request` (retries, failover, the API key) and sends only through it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from drgrpo_jax.config.engines import ENGINE_TRAITS, EngineName, EngineTraits

__all__ = ["Call", "Engine", "Request", "Sampling"]


class Request(Protocol):
    """The client's HTTP call: `method` `url + path` with JSON `body`; the answer's JSON, or RolloutError."""

    def __call__(self, method: str, url: str, path: str, body: Any = None) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One generate call's sampling settings, as every request of it carries them."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool  # the model's EOS does not end a completion (stop_token_ids still do)
    routed_experts: bool  # each completion also brings the experts its tokens were routed to


@dataclasses.dataclass(frozen=True)
class Call:
    """One request of a generate call: posted to the URL of share `share` (failing over to the others), it answers
    `num_prompts` x G completions."""

    share: int
    path: str
    body: dict[str, Any]
    num_prompts: int


class Engine(abc.ABC):
    """One inference engine's wire: requests out, SGLang `/generate` items back, start-up checks, weight pushes."""

    name: ClassVar[EngineName]  # its rollout.engine value
    in_flight: ClassVar[int] = 0  # requests a client keeps open at once, when more than one per URL

    @property
    def traits(self) -> EngineTraits:
        """What it supports (config/engines.py)."""
        return ENGINE_TRAITS[self.name]

    @abc.abstractmethod
    def generate_calls(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                       shares: Sequence[tuple[int, int]], group_size: int, sampling: Sampling) -> list[Call]:
        """The requests that sample G completions of every prompt, prompt i with seed seeds[i], share k's prompts
        prompts[start:stop] (shares[k]) in share order; their answers, in order, are the completions in prompt order."""

    def completion_items(self, answer: Any, group_size: int) -> list[dict[str, Any]]:
        """One call's answer as SGLang `/generate` items (`output_ids`, `meta_info`), in the order asked."""
        return answer if isinstance(answer, list) else [answer]

    def check_startup(self, url: str, request: Request) -> bool:
        """ConfigError naming a start-up setting the server at `url` lacks; whether it honours sampling seeds."""
        return True

    def check_routed_experts(self, url: str, request: Request) -> None:
        """ConfigError (model.moe.router_replay) when the server at `url` does not return routed experts."""
        return  # SGLang's wire has no setting to read: a completion without them is refused as it is decoded

    @abc.abstractmethod
    def push_weights(self, url: str, model_path: str, version: str, rollback: bool, request: Request) -> None:
        """Has the server at `url` load the folder `model_path` as `version` (`rollback`: it may be older than the
        one it holds); RolloutError naming the URL when it refuses."""
