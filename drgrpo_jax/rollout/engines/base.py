"""The interface every inference engine behind `rollout.urls` implements for the rollout client.

An engine turns one generate call into its own requests and reads its answers into checked `Completion`s, reads a
server's start-up settings, and pushes weights. Every answer is read through the checks below (`read_sglang_items`,
`token_ids`, `checked_tokens`, `one_per_index`): a server is trusted with nothing, and a bad answer is one
RolloutError naming the field (the client adds the URL and route).
What it supports is its row of `config/engines.py` (`traits`). The client holds one engine and asks it; it never
compares names. Every method gets the client's `Request` (retries, failover, the API key) and sends only through it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from drgrpo_jax.config.engines import ENGINE_TRAITS, EngineName, EngineTraits
from drgrpo_jax.errors import RolloutError

__all__ = ["Call", "Completion", "Engine", "PrefixCacheStats", "Request", "Sampling", "checked_tokens", "described",
           "finish_is_length", "json_object", "one_per_index", "read_prefix_cache", "read_sglang_items", "token_ids",
           "token_versions", "version_text"]

INT32_END = 2**31  # token ids are stored as int32: the bound when the vocabulary is not known
LOGPROB_SLACK = 1e-3  # a log-prob this far above 0 is rounding; beyond it the service overflowed


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
class Completion:
    """One completion read from an engine's answer, every field checked."""

    ids: list[int]  # each in [0, vocabulary)
    logprobs: list[float]  # one finite log-prob <= 0 per id
    truncated: bool  # hit the budget without a stop token
    weight_version: str | None  # the oldest weights that sampled it, as the service names them
    token_versions: list[int]  # each token's version, -1 where not an integer
    routed_experts: str | None = None  # SGLang's base64 of little-endian int32, decoded by the client when asked


@dataclasses.dataclass(frozen=True)
class Call:
    """One request of a generate call: posted to the URL of share `share`, it answers G completions of each of
    `prompts` (indices into the call's prompts), in that order."""

    share: int
    path: str
    body: dict[str, Any]
    prompts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """A service's prefix cache as its `/get_model_info` reports it (`prefix_cache`): counts since it started and
    its size now; summed (`+`) over services."""

    hit_tokens: int  # prompt tokens read from the cache, not prefilled
    miss_tokens: int  # prompt tokens prefilled
    evicted_blocks: int
    cached_blocks: int  # held now
    budget_bytes: int

    def since(self, earlier: PrefixCacheStats | None) -> PrefixCacheStats:
        """The counts since `earlier` (a reading of the same service), the size as now; all of them when there is no
        earlier reading or a count went back (the service restarted)."""
        counts = ("hit_tokens", "miss_tokens", "evicted_blocks")
        if earlier is None or any(getattr(self, name) < getattr(earlier, name) for name in counts):
            return self
        return dataclasses.replace(self, **{name: getattr(self, name) - getattr(earlier, name) for name in counts})

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def then(self, later: PrefixCacheStats) -> PrefixCacheStats:
        """These counts followed by `later`'s (the next round's): the counts add up, the size is the later one."""
        return dataclasses.replace(self + later, cached_blocks=later.cached_blocks, budget_bytes=later.budget_bytes)


def read_prefix_cache(value: Any, field: str) -> PrefixCacheStats | None:
    """A `prefix_cache` object as checked counts (each an integer >= 0); None when the service reports none, or one
    of no budget (a service with its cache turned off)."""
    if value is None:
        return None
    _field(value, dict, field)
    counts = {}
    for name in (f.name for f in dataclasses.fields(PrefixCacheStats)):
        count = value.get(name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise RolloutError(f"{field}.{name}: {described(count)} is not a count (an integer >= 0)")
        counts[name] = count
    return PrefixCacheStats(**counts) if counts["budget_bytes"] else None


class Engine(abc.ABC):
    """One inference engine's wire: requests out, SGLang `/generate` items back, start-up checks, weight pushes."""

    name: ClassVar[EngineName]  # its rollout.engine value
    in_flight: ClassVar[int] = 0  # requests a client keeps open at once, when more than one per URL

    @property
    def traits(self) -> EngineTraits:
        """What it supports (config/engines.py)."""
        return ENGINE_TRAITS[self.name]

    @abc.abstractmethod
    def generate_calls(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], shares: Sequence[Sequence[int]],
                       group_size: int, sampling: Sampling) -> list[Call]:
        """The requests that sample G completions of the prompts of every share (shares[k]: indices into `prompts`,
        all sent to one URL), prompt i with seed seeds[i]; each names its share and the prompts it answers."""

    def read_completions(self, answer: Any, group_size: int, vocab_size: int | None) -> list[Completion]:
        """One call's answer (SGLang `/generate` items) as its checked completions, in the order asked; ids below
        `vocab_size` (None: unknown, int32)."""
        return read_sglang_items(answer, vocab_size)

    def vocab_size(self, url: str, request: Request) -> int | None:
        """The vocabulary size the server at `url` reports; None when it reports none."""
        return None

    def check_startup(self, url: str, request: Request) -> bool:
        """ConfigError naming a start-up setting the server at `url` lacks; whether it honours sampling seeds."""
        return True

    def check_routed_experts(self, url: str, request: Request) -> None:
        """ConfigError (model.moe.router_replay) when the server at `url` does not return routed experts."""
        return  # SGLang's wire has no setting to read: a completion without them is refused as it is decoded

    def prefix_cache(self, url: str, request: Request) -> PrefixCacheStats | None:
        """What the prefix cache of the server at `url` reports now; None when it reports none."""
        return None

    @abc.abstractmethod
    def push_weights(self, url: str, model_path: str, version: str, rollback: bool, request: Request) -> None:
        """Has the server at `url` load the folder `model_path` as `version` (`rollback`: it may be older than the
        one it holds); RolloutError naming the URL when it refuses."""


def described(value: Any) -> str:
    """A short description of an answer's value for an error line: a scalar as itself, a container by its type
    (never its repr: an answer may nest deep or run long)."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
        return text if len(text) <= 40 else f"an integer of {len(text)} digits"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    return "an object" if isinstance(value, dict) else "a list" if isinstance(value, list) else type(value).__name__


def json_object(value: Any, field: str) -> dict[str, Any]:
    """`value` when it is a JSON object; RolloutError naming `field` otherwise (a start-up or push answer)."""
    return _field(value, dict, field)


def _field(value: Any, kind: type, field: str) -> Any:
    """`value` when it is a `kind` (a JSON object or list); RolloutError naming `field` otherwise."""
    if not isinstance(value, kind):
        raise RolloutError(f"{field}: {described(value)}, not {'an object' if kind is dict else 'a list'}")
    return value


def token_id(value: Any, field: str, vocab_size: int | None) -> int:
    """`value` when it is an integer token id of the vocabulary ([0, vocab_size), or int32 when unknown)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RolloutError(f"{field}: {described(value)} is not a token id (an integer)")
    if not 0 <= value < (vocab_size or INT32_END):
        bound = f"the vocabulary ({vocab_size})" if vocab_size else "[0, 2**31)"
        raise RolloutError(f"{field}: token id {described(value)} is outside {bound}")
    return value


def token_ids(value: Any, field: str, vocab_size: int | None) -> list[int]:
    """A list of token ids of the vocabulary; RolloutError naming the first that is not one."""
    return [token_id(t, f"{field}[{i}]", vocab_size) for i, t in enumerate(_field(value, list, field))]


def logprob(value: Any, field: str) -> float:
    """A finite log-probability <= 0 (a service that overflowed must not be trained on)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            value > LOGPROB_SLACK:
        raise RolloutError(f"{field}: {described(value)} is not a finite log-probability <= 0; the service's "
                           "answer cannot be trained on")
    return float(value)


def checked_tokens(ids: list[int], entries: Sequence[tuple[str, Any, Any]],
                   vocab_size: int | None) -> list[float]:
    """The log-probs of checked `ids` from one log-prob entry per id, each (field, log-prob, token id), the entry's
    id that of its position."""
    logprobs = []
    for position, (field, value, entry_id) in enumerate(entries):
        if token_id(entry_id, field, vocab_size) != ids[position]:
            raise RolloutError(f"{field}: token id {entry_id} is not the output's {ids[position]} (not aligned)")
        logprobs.append(logprob(value, field))
    return logprobs


def one_per_index(choices: Any, count: int, field: str) -> list[dict[str, Any]]:
    """`count` choices (objects), one per `index` 0..count-1, in index order; RolloutError naming the choice whose
    index is missing, not an integer, out of range or repeated."""
    _field(choices, list, field)
    if len(choices) != count:
        raise RolloutError(f"{field}: {len(choices)} choices, expected {count}")
    ordered: list[dict[str, Any] | None] = [None] * count
    for k, choice in enumerate(choices):
        index = _field(choice, dict, f"{field}[{k}]").get("index")
        where = f"{field}[{k}].index"
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise RolloutError(f"{where}: {described(index)} is not an integer in [0, {count})")
        if ordered[index] is not None:
            raise RolloutError(f"{where}: {index} again (one choice per index)")
        ordered[index] = choice
    return ordered  # type: ignore[return-value]  # every slot is filled: count choices, no index twice


def finish_is_length(finish: Any, field: str) -> bool:
    """Whether a completion stopped at the budget: SGLang reports {'type': 'stop'|'length'|'abort', ...},
    OpenAI-style servers a plain string."""
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        raise RolloutError(f"{field}: {described(kind)} (the request was aborted or the server is not SGLang-like)")
    return kind == "length"


def version_text(value: Any, field: str) -> str | None:
    """A weight version as its text (a string or an integer; an integer one below 2**31, as versions are kept as
    int32); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RolloutError(f"{field}: {described(value)} is not a weight version")
    text = str(value)
    if _integer_version(text) >= INT32_END or (isinstance(value, int) and value < 0):
        raise RolloutError(f"{field}: weight version {described(value)} is outside [0, 2**31)")
    return text


def _integer_version(version: str | None) -> int:
    """A version's integer; -1 when it is not one (a name such as 'default')."""
    return int(version) if version is not None and version.isascii() and version.isdigit() else -1


def token_versions(reported: Any, field: str, num_tokens: int, row_version: str | None) -> list[int]:
    """Each token's version as an int (-1: not an integer): `reported` (one per output token) where the service
    reports it, else the row's version on every token; a reported version must be an integer or the row's."""
    if reported is None:
        return [_integer_version(row_version)] * num_tokens
    if not isinstance(reported, list) or len(reported) != num_tokens:
        raise RolloutError(f"{field}: not a list of one version per output token ({num_tokens})")
    out = []
    for position, value in enumerate(reported):
        version = version_text(value, f"{field}[{position}]")
        if _integer_version(version) < 0 and (version is None or version != row_version):
            raise RolloutError(f"{field}[{position}]: {described(value)} is neither an integer version nor the "
                               f"completion's weight_version {row_version!r}")
        out.append(_integer_version(version))
    return out


def read_sglang_items(answer: Any, vocab_size: int | None) -> list[Completion]:
    """SGLang `/generate` items (a list, or one object) as checked completions."""
    items = answer if isinstance(answer, list) else [_field(answer, dict, "the answer")]
    return [_sglang_item(item, f"[{r}]", vocab_size) for r, item in enumerate(items)]


def _sglang_item(item: Any, where: str, vocab_size: int | None) -> Completion:
    """One SGLang item (`output_ids`, `meta_info`) as a checked completion."""
    ids = token_ids(_field(item, dict, where).get("output_ids"), f"{where}.output_ids", vocab_size)
    meta = _field(item.get("meta_info"), dict, f"{where}.meta_info")
    field = f"{where}.meta_info.output_token_logprobs"
    pairs = _field(meta.get("output_token_logprobs"), list, field)
    if len(pairs) != len(ids):
        raise RolloutError(f"{field}: {len(pairs)} entries for {len(ids)} output_ids (not aligned)")
    entries = []
    for position, pair in enumerate(pairs):
        if not isinstance(pair, list) or len(pair) < 2:
            raise RolloutError(f"{field}[{position}]: {described(pair)}, not [log-prob, token id, text]")
        entries.append((f"{field}[{position}]", pair[0], pair[1]))
    logprobs = checked_tokens(ids, entries, vocab_size)
    version = version_text(meta.get("weight_version"), f"{where}.meta_info.weight_version")
    experts = meta.get("routed_experts")
    return Completion(ids=ids, logprobs=logprobs,
                      truncated=finish_is_length(meta.get("finish_reason"), f"{where}.meta_info.finish_reason"),
                      weight_version=version,
                      token_versions=token_versions(meta.get("output_token_weight_versions"),
                                                    f"{where}.meta_info.output_token_weight_versions", len(ids),
                                                    version),
                      routed_experts=experts if isinstance(experts, str) else None)
