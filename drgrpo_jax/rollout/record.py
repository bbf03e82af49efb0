"""The typed rollout record, from sampled and scored completions to a training batch: host-side and pure.

`ScoredRollout` holds P groups of G responses with named per-row arrays (prompt-major: row
p * G + g); `take(groups)` selects groups (dynamic sampling), `concat` joins rounds, `to_batch`
builds the step's `Batch`, and the algorithm table says what its advantages and learning signal are.
`HostCounters` holds what is not one per row (wall-clock, reward timeouts and errors, the services' prefix cache)
and adds up over rounds and hosts. Beside them: each host's share of a rollout, correctness and length statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from drgrpo_jax.rewards.functions import CORRECTNESS_REWARDS, failure_metrics
from drgrpo_jax.rollout.engines.base import PrefixCacheStats
from drgrpo_jax.rollout.prefix_cache import prefix_cache_metrics
from drgrpo_jax.step.batch import Batch

if TYPE_CHECKING:
    from drgrpo_jax.algorithms import Algorithm
    from drgrpo_jax.data.examples import Example

__all__ = ["EPISODE_COLUMNS", "HostCounters", "ScoredRollout", "correct_mask", "host_share", "left_pad",
           "merge_host_rows", "response_stats", "routed_layout"]


# A multi-turn row's episode counts (environments/trajectory.py), the columns of ScoredRollout.episodes.
EPISODE_COLUMNS = ("turns", "tool_calls", "tool_errors", "malformed_calls", "tool_seconds", "model_tokens",
                   "environment_tokens")

_PER_ROW = {"per_row": True}  # a field with one entry per response: what take, concat and the hosts' gather carry


@dataclasses.dataclass(frozen=True)
class ScoredRollout:
    """P prompts x G responses, prompt-major (row p * G + g), padded to T token positions (the generation budget).

    Each array has the name it has everywhere (`Completions` of rollout/client.py, `Batch` of step/batch.py);
    `row_arrays` and `from_prompts` carry the per-row fields by name through the hosts' gather.
    """

    examples: tuple[Example, ...]  # [P]
    prompt_ids: tuple[tuple[int, ...], ...]  # [P] chat-templated prompt token ids
    group_valid: np.ndarray  # bool [P]: False = a padding group (no loss, no statistics)
    response_ids: np.ndarray = dataclasses.field(metadata=_PER_ROW)  # int32 [N, T], 0 after each response's end
    # float32 [N, T]: the sampler's (temperature-scaled), 0 on padding
    behaviour_logprobs: np.ndarray = dataclasses.field(metadata=_PER_ROW)
    response_mask: np.ndarray = dataclasses.field(metadata=_PER_ROW)  # bool [N, T]: generated tokens
    lengths: np.ndarray = dataclasses.field(metadata=_PER_ROW)  # int32 [N]
    truncated: np.ndarray = dataclasses.field(metadata=_PER_ROW)  # bool [N]: hit the budget without a stop token
    # int64 [N]: the weight version each response was sampled with
    weight_versions: np.ndarray = dataclasses.field(metadata=_PER_ROW)
    components: np.ndarray = dataclasses.field(metadata=_PER_ROW)  # float32 [N, K]: reward components
    # Multi-turn rows: bool [N, T] True on the model's tokens (None: every response token) and float32
    # [N, len(EPISODE_COLUMNS)] the episode counts (None: zeros, a single-turn rollout).
    loss_mask: np.ndarray | None = dataclasses.field(default=None, metadata=_PER_ROW)
    episodes: np.ndarray | None = dataclasses.field(default=None, metadata=_PER_ROW)
    # int64 [N, T]: the version that sampled each token, -1 on padding (a service with --inflight-updates switches
    # versions within a response; None: the response's version on every token)
    token_versions: np.ndarray | None = dataclasses.field(default=None, metadata=_PER_ROW)
    # Router replay: int32 [N, U + T, L, k], the experts the service's router chose for each token it read, laid out
    # as the batch's prompt (left-padded to U) ++ response (`routed_layout`); None = not asked for.
    routed_experts: np.ndarray | None = dataclasses.field(default=None, metadata=_PER_ROW)

    def __post_init__(self):
        if self.loss_mask is None:
            object.__setattr__(self, "loss_mask", self.response_mask)
        if self.episodes is None:
            object.__setattr__(self, "episodes", np.zeros((len(self.response_ids), len(EPISODE_COLUMNS)), np.float32))
        if self.token_versions is None:
            object.__setattr__(self, "token_versions",
                               np.where(self.response_mask, np.asarray(self.weight_versions)[:, None], -1))
        num_prompts, num_rows = len(self.examples), len(self.response_ids)
        if len(self.prompt_ids) != num_prompts or len(self.group_valid) != num_prompts:
            raise ValueError(f"ScoredRollout: {num_prompts} examples, {len(self.prompt_ids)} prompts and "
                             f"{len(self.group_valid)} group_valid flags")
        if num_prompts == 0 or num_rows % num_prompts:
            raise ValueError(f"ScoredRollout: {num_rows} responses do not form groups of {num_prompts} prompts")
        for name, value in self.row_arrays().items():
            if len(value) != num_rows:
                raise ValueError(f"ScoredRollout.{name}: {len(value)} rows, expected {num_rows}")

    @property
    def group_size(self) -> int:
        """G: responses per prompt."""
        return len(self.response_ids) // len(self.examples)

    @property
    def row_valid(self) -> np.ndarray:
        """bool [N]: responses of real (not padding) groups."""
        return np.repeat(self.group_valid, self.group_size)

    def row_arrays(self) -> dict[str, np.ndarray]:
        """The per-row fields by name (what the hosts all-gather); a field left None is not one."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("per_row") and getattr(self, f.name) is not None}

    @classmethod
    def from_prompts(cls, examples: Sequence[Example], prompt_ids: Sequence[Sequence[int]],
                     **row_arrays: np.ndarray) -> ScoredRollout:
        """The rollout of these prompts, every group valid, from its per-row fields by name."""
        return cls(tuple(examples), tuple(tuple(p) for p in prompt_ids), np.ones(len(examples), bool), **row_arrays)

    def take(self, groups: Sequence[int]) -> ScoredRollout:
        """The groups at these indices, in this order, with their rows and validity."""
        picked = np.asarray(groups, np.int64)
        row_index = (picked[:, None] * self.group_size + np.arange(self.group_size)).reshape(-1)
        return dataclasses.replace(self, examples=tuple(self.examples[g] for g in picked),
                                   prompt_ids=tuple(self.prompt_ids[g] for g in picked),
                                   group_valid=self.group_valid[picked],
                                   **{name: value[row_index] for name, value in self.row_arrays().items()})

    @staticmethod
    def concat(parts: Sequence[ScoredRollout]) -> ScoredRollout:
        """The rollouts one after the other (same group size and budget)."""
        first = parts[0]
        return dataclasses.replace(first, examples=tuple(e for p in parts for e in p.examples),
                                   prompt_ids=tuple(ids for p in parts for ids in p.prompt_ids),
                                   group_valid=np.concatenate([p.group_valid for p in parts]),
                                   **{name: np.concatenate([getattr(p, name) for p in parts])
                                      for name in first.row_arrays()})

    def components_PGK(self) -> np.ndarray:
        """float32 [P, G, K]: the reward components by group."""
        return self.components.reshape(len(self.examples), self.group_size, -1)

    def valid_PG(self) -> np.ndarray:
        """bool [P, G]: responses of real (not padding) groups."""
        return np.repeat(self.group_valid[:, None], self.group_size, axis=1)

    def advantages_N(self, algorithm: Algorithm, weights_K: Sequence[float], *, scale_rewards: bool = False,
                     whiten_advantages: bool = False) -> np.ndarray:
        """float32 [N]: the algorithm's group-stage advantages (`Algorithm.group_advantages`); padding groups get 0.

        What comes after, per optimizer window, is `Algorithm.window_advantages`.
        """
        advantages = algorithm.group_advantages(self.components_PGK(), weights_K, self.valid_PG(),
                                                scale_rewards=scale_rewards, whiten_advantages=whiten_advantages)
        return np.asarray(advantages, np.float32).reshape(-1)

    def signal_P(self, algorithm: Algorithm, weights_K: Sequence[float]) -> np.ndarray:
        """bool [P]: valid groups with a learning signal, by the algorithm's own test."""
        return np.asarray(algorithm.group_signal(self.components_PGK(), weights_K, self.valid_PG()), bool)

    def to_batch(self, advantages_N: np.ndarray, prompt_length: int) -> Batch[np.ndarray]:
        """The step's host batch (numpy): prompts left-padded to prompt_length; old log-probs still zero."""
        prompt_ids, prompt_mask = left_pad(self.prompt_ids, prompt_length, self.group_size)
        routed = self.routed_experts
        if routed is not None and routed.shape[1] != prompt_length + self.response_ids.shape[1]:
            raise ValueError(f"ScoredRollout.routed_experts: {routed.shape[1]} positions, not prompt_length "
                             f"{prompt_length} + the budget {self.response_ids.shape[1]}")
        return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=self.response_ids,
                     response_mask=self.response_mask, advantages=np.asarray(advantages_N, np.float32),
                     old_logprobs=np.zeros_like(self.behaviour_logprobs),
                     behaviour_logprobs=self.behaviour_logprobs, row_valid=self.row_valid,
                     loss_mask=self.loss_mask, routed_experts=routed)


@dataclasses.dataclass(frozen=True)
class HostCounters:
    """What sampling and scoring cost and what failed: not one value per row; adds up over rounds and hosts."""

    reward_functions: tuple[str, ...]  # F reward function names
    rollout_seconds: float  # waiting for the generation service
    reward_seconds: float  # scoring
    reward_timeouts_F: np.ndarray  # int [F]: reward calls killed at the time limit
    reward_errors_F: np.ndarray  # int [F]: reward calls that raised or killed their worker
    error_messages: tuple[str, ...] = ()  # the first few reward failures (this host's), for the log
    # What the services' prefix caches did during the round, as this host read them after it (RolloutClient.
    # prefix_cache_delta); None when no service reports a cache. The services serve every host, so one host's
    # reading is the fleet's: it is not gathered.
    prefix_cache: PrefixCacheStats | None = None

    def __add__(self, other: HostCounters) -> HostCounters:
        """Sequential work (dynamic sampling's rounds): times and counts add up."""
        caches = [cache for cache in (self.prefix_cache, other.prefix_cache) if cache is not None]
        return HostCounters(self.reward_functions, self.rollout_seconds + other.rollout_seconds,
                            self.reward_seconds + other.reward_seconds,
                            self.reward_timeouts_F + other.reward_timeouts_F,
                            self.reward_errors_F + other.reward_errors_F,
                            (self.error_messages + other.error_messages)[:5],
                            caches[0].then(caches[1]) if len(caches) == 2 else next(iter(caches), None))

    def arrays(self) -> dict[str, np.ndarray]:
        """The numbers as arrays (what the hosts all-gather)."""
        return {"seconds": np.asarray([self.rollout_seconds, self.reward_seconds]),
                "timeouts_F": np.asarray(self.reward_timeouts_F, np.int64),
                "errors_F": np.asarray(self.reward_errors_F, np.int64)}

    def across_hosts(self, stacked: dict[str, np.ndarray]) -> HostCounters:
        """Every host's `arrays()` stacked [hosts, ...] -> parallel work: the slowest host's time, summed counts."""
        seconds = stacked["seconds"].max(axis=0)
        return HostCounters(self.reward_functions, float(seconds[0]), float(seconds[1]),
                            stacked["timeouts_F"].sum(axis=0), stacked["errors_F"].sum(axis=0), self.error_messages,
                            self.prefix_cache)

    def metrics(self) -> dict[str, float | None]:
        """Per-function and total reward timeouts and errors, and the services' prefix cache when they report one,
        for metrics.jsonl."""
        return {**failure_metrics(self.reward_functions, self.reward_timeouts_F, self.reward_errors_F),
                **({} if self.prefix_cache is None else prefix_cache_metrics(self.prefix_cache))}


def merge_host_rows(stacked: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every host's rows stacked on a leading host axis [hosts, N, ...] -> the whole rollout [hosts * N, ...].

    Host h's rows follow host h - 1's, which is the prompt order of a one-host rollout because the
    shares are contiguous (`host_share`).
    """
    return {name: value.reshape(value.shape[0] * value.shape[1], *value.shape[2:]) for name, value in stacked.items()}


def host_share(num_prompts: int, num_hosts: int, host: int) -> tuple[int, int]:
    """[start, stop) of the prompts host `host` samples and scores: equal contiguous shares in host order."""
    if num_prompts % num_hosts:
        raise ValueError(f"rollout.prompts_per_step: {num_prompts} prompts do not split evenly over {num_hosts} hosts")
    if not 0 <= host < num_hosts:
        raise ValueError(f"host: {host} is not in [0, {num_hosts})")
    size = num_prompts // num_hosts
    return host * size, (host + 1) * size


def correct_mask(names: tuple[str, ...], components_NK: np.ndarray) -> np.ndarray:
    """bool [N]: full credit on a correctness component (math_verify/task) if any, else a positive reward."""
    columns = [k for k, name in enumerate(names) if name in CORRECTNESS_REWARDS]
    if columns:
        return np.asarray((components_NK[:, columns] >= 1.0).any(axis=1))
    return components_NK.sum(axis=1) > 0


def _mean_or_none(values: np.ndarray) -> float | None:
    """The mean, or None (JSON null) when there is nothing to average: never a made-up 0."""
    return float(values.mean()) if values.size else None


def response_stats(lengths_N: np.ndarray, truncated_N: np.ndarray, correct_N: np.ndarray) -> dict[str, Any]:
    """Accuracy and response lengths split by correctness."""
    return {
        "accuracy": float(correct_N.mean()),
        "response_length_mean": float(lengths_N.mean()),
        "response_length_correct": _mean_or_none(lengths_N[correct_N]),
        "response_length_incorrect": _mean_or_none(lengths_N[~correct_N]),
        "truncated_fraction": float(truncated_N.mean()),
    }


def left_pad(prompts: Sequence[Sequence[int]], length: int, repeat: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids and mask [len(prompts) * repeat, length], left-padded with 0, each prompt repeated."""
    ids = np.zeros((len(prompts) * repeat, length), np.int32)
    for p, prompt in enumerate(prompts):
        ids[p * repeat:(p + 1) * repeat, length - len(prompt):] = prompt
    lengths = np.repeat([len(p) for p in prompts], repeat)
    return ids, np.arange(length)[None, :] >= length - lengths[:, None]


def routed_layout(experts: Sequence[np.ndarray], prompt_lengths: Sequence[int], prompt_length: int,
                  budget: int) -> np.ndarray:
    """int32 [N, U + T, L, k]: each row's experts [prompt + completion - 1, L, k] (`Completions.routed_experts`) at
    the positions of the tokens they routed in prompt_ids (left-padded to U = prompt_length) ++ response_ids (T =
    budget); 0 (a valid expert, never read) on padding and the last token."""
    L, k = experts[0].shape[1:]
    out = np.zeros((len(experts), prompt_length + budget, L, k), np.int32)
    for n, (read, prompt) in enumerate(zip(experts, prompt_lengths)):
        start = prompt_length - prompt  # the row's first prompt token
        out[n, start:start + len(read)] = read
    return out
