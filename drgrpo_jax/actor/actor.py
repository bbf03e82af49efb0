"""The actor: what samples and scores. An `Actor` holds the generation client, the reward scorer, the tokenizer
and, for multi-turn runs, the environment's episodes; `sample_and_score` turns prompts into scored completions for
training (`train/collect.py`) and evaluation (`evaluate/evaluation.py`) alike.

Shape letters (docs/shape_letters.md): N completions, T token positions, K reward components.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from drgrpo_jax.data.prompts import tokenize_prompt
from drgrpo_jax.environments.trajectory import Trajectory, run_episodes, trajectory_arrays
from drgrpo_jax.errors import ConfigError, RolloutError
from drgrpo_jax.rollout.record import EPISODE_COLUMNS, HostCounters, routed_layout

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import DataConfig
    from drgrpo_jax.data.examples import Example
    from drgrpo_jax.environments.build import Episodes
    from drgrpo_jax.rewards.functions import RewardResult
    from drgrpo_jax.rewards.scorer import RewardScorer
    from drgrpo_jax.rollout.client import Completions, RolloutClient, RouterShape

__all__ = ["Actor", "GroupSampling", "Scored"]


@dataclasses.dataclass(frozen=True)
class GroupSampling:
    """How each prompt is answered: `group` completions at these settings."""

    group: int
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False  # the model's EOS does not end a completion (a fixed-length benchmark)
    max_staleness: int = 0  # how many versions older than the expected one a completion may be


@dataclasses.dataclass(frozen=True)
class Scored:
    """G scored completions of each prompt, prompt-major (completion p * G + g)."""

    texts: tuple[str, ...]  # [N] decoded (an episode: its last model turn)
    rewards: RewardResult
    counters: HostCounters
    model_tokens: np.ndarray  # int [N]: tokens the model generated (an episode: over all its turns)
    truncated: np.ndarray  # bool [N]: cut by the budget (an episode: by a token limit)
    rows: dict[str, np.ndarray] | None = None  # the rollout record's per-row fields, when asked for


def _version_number(version: str | None) -> int:
    """A completion's weight version as a number (generate has checked it against the expected step)."""
    if version is None:
        raise ValueError("weight_version: the generation service reported none for a completion")
    return int(version)


@dataclasses.dataclass(frozen=True)
class Actor:
    """The client, the scorer and the tokenizer a run samples and scores with; `episodes` makes each completion a
    multi-turn episode, `router` brings back each completion's routed experts (model.moe.router_replay)."""

    client: RolloutClient
    scorer: RewardScorer
    tokenizer: Any  # a Hugging Face tokenizer
    episodes: Episodes | None = None
    router: RouterShape | None = None

    @property
    def stop_ids(self) -> list[int]:
        """The token ids that end a completion: the tokenizer's EOS, if it has one."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [int(eos)] if eos is not None else []

    def prompt_ids(self, examples: Sequence[Example], data: DataConfig,
                   max_prompt_tokens: int | None = None) -> list[list[int]]:
        """Chat-templated prompt ids (episodes: the environment's opening); a prompt over max_prompt_tokens is an
        error naming it and rollout.max_prompt_tokens, raised when the prompt is drawn."""
        prompts = [self._opening(example) if self.episodes is not None else
                   tokenize_prompt(example, data, self.tokenizer) for example in examples]
        for example, ids in zip(examples, prompts):
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                raise ConfigError("rollout.max_prompt_tokens", f"prompt {example.prompt_id} has {len(ids)} tokens, "
                                                               f"over the limit {max_prompt_tokens}")
        return prompts

    def _opening(self, example: Example) -> list[int]:
        """An episode's prompt: its environment's opening messages through the chat template (tools described)."""
        assert self.episodes is not None
        environment = self.episodes.make_environment()
        return self.episodes.renderer(environment).opening_ids(environment.reset(self.episodes.example(example)))

    def sample_and_score(self, examples: Sequence[Example], prompts: Sequence[Sequence[int]],
                         sampling: GroupSampling, *, seed: int, expected_version: int | None = None,
                         prompt_offset: int = 0, first_url: int = 0,
                         record_prompt_tokens: int | None = None) -> Scored:
        """`sampling.group` completions of each prompt, decoded and scored; with `record_prompt_tokens` (the
        record's prompt columns, rollout.max_prompt_tokens) also the rollout record's rows.

        `prompt_offset`: the index of prompts[0] in the whole batch, so a share draws the seeds the whole would
        (each prompt's, each episode's turn seeds); `first_url`: the service that takes the first share.
        """
        grouped = [e for e in examples for _ in range(sampling.group)]
        start = time.perf_counter()
        if self.episodes is not None:
            trajectories = self._episodes(grouped, prompts, sampling, seed, expected_version, prompt_offset)
            texts = [t.final_answer for t in trajectories]
            model_tokens = np.asarray([t.model_tokens for t in trajectories], np.int32)
            truncated = np.asarray([t.finish in ("max_model_tokens", "max_total_tokens") for t in trajectories])
            given = self.episodes.given_rewards(trajectories)
        else:
            completions = self.client.generate(
                prompts, sampling.group, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=[] if sampling.ignore_eos else self.stop_ids,
                ignore_eos=sampling.ignore_eos, seed=seed, expected_version=expected_version,
                max_staleness=sampling.max_staleness, prompt_offset=prompt_offset, first_url=first_url,
                return_routed_experts=self.router)
            texts = self.tokenizer.batch_decode(
                [ids[:n] for ids, n in zip(completions.response_ids, completions.lengths)], skip_special_tokens=True)
            model_tokens, truncated, given = completions.lengths, completions.truncated, {}
        rollout_seconds = time.perf_counter() - start
        prefix_cache = self.client.prefix_cache_delta()
        start = time.perf_counter()
        rewards = self.scorer.score(texts, grouped, model_tokens, given=given)
        counters = HostCounters(rewards.functions, rollout_seconds, time.perf_counter() - start, rewards.timeouts_F,
                                rewards.errors_F, rewards.error_messages, prefix_cache)
        rows = None
        if record_prompt_tokens is not None:
            rows = (_episode_rows(trajectories, sampling.max_new_tokens) if self.episodes is not None else
                    _completion_rows(completions, prompts, sampling.group, record_prompt_tokens,
                                     sampling.max_new_tokens))
            rows["components"] = rewards.components_NK
        return Scored(tuple(texts), rewards, counters, np.asarray(model_tokens), np.asarray(truncated, bool), rows)

    def _episodes(self, grouped: list[Example], prompts: Sequence[Sequence[int]], sampling: GroupSampling, seed: int,
                  expected_version: int | None, prompt_offset: int) -> list[Trajectory]:
        """One multi-turn episode per grouped example (environments/trajectory.py); each opens with its prompt."""
        episodes = self.episodes
        assert episodes is not None
        trajectories = run_episodes(
            self.client, self.tokenizer, episodes.make_environment, [episodes.example(e) for e in grouped],
            limits=episodes.limits, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, renderer=episodes.renderer, expected_version=expected_version,
            max_staleness=sampling.max_staleness, first_episode=prompt_offset * sampling.group)
        for i, trajectory in enumerate(trajectories):
            if trajectory.prompt_ids != list(prompts[i // sampling.group]):
                raise RolloutError(f"episode {i}: its opening renders to other ids than the rollout's prompt "
                                   "(an environment whose reset depends on more than the example?)")
        return trajectories


def _completion_rows(completions: Completions, prompts: Sequence[Sequence[int]], group: int, prompt_tokens: int,
                     budget: int) -> dict[str, np.ndarray]:
    """Single-turn completions as the record's per-row fields (router replay: their experts laid out as tokens)."""
    rows = {"response_ids": completions.response_ids, "behaviour_logprobs": completions.behaviour_logprobs,
            "response_mask": completions.response_mask, "lengths": completions.lengths,
            "truncated": completions.truncated,
            "weight_versions": np.asarray([_version_number(v) for v in completions.weight_versions], np.int64),
            "token_versions": completions.token_versions.astype(np.int64)}
    if completions.routed_experts is not None:
        lengths = [len(prompts[n // group]) for n in range(len(completions.routed_experts))]
        rows["routed_experts"] = routed_layout(completions.routed_experts, lengths, prompt_tokens, budget)
    return rows


def _episode_rows(trajectories: Sequence[Trajectory], budget: int) -> dict[str, np.ndarray]:
    """Episodes as the record's per-row fields: the whole trajectory, the model's tokens in `loss_mask`, the
    oldest version of any turn, and the episode counts."""
    rows = trajectory_arrays(trajectories, budget)
    return {"response_ids": rows.response_ids, "behaviour_logprobs": rows.behaviour_logprobs,
            "response_mask": rows.response_mask, "loss_mask": rows.loss_mask,
            "lengths": np.asarray([len(t.ids) for t in trajectories], np.int32),
            "truncated": np.asarray([t.finish in ("max_model_tokens", "max_total_tokens") for t in trajectories]),
            "weight_versions": np.asarray([min(_version_number(v) for v in t.weight_versions)
                                           for t in trajectories], np.int64),
            "episodes": np.asarray([[getattr(t, column) for column in EPISODE_COLUMNS] for t in trajectories],
                                   np.float32)}
