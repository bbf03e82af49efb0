"""The token-exact episode driver: each model turn sampled through the generation service, ids in and ids out.

A trajectory is its prompt's ids, then one row of ids after it: model turns (as the service sampled them, with
their behaviour log-probs) and environment turns (the template's text after a model turn, tokenised alone; see
environments/chat.py), and a mask that is True exactly on the model's tokens. Nothing is decoded and re-tokenised:
the model's text is decoded only for the environment to read. The next turn's prompt is the prompt's ids and the
row so far, so the service scores every model token in the context the trainer recomputes.

Limits: `max_turns` model turns, `max_turn_tokens` per turn, `max_model_tokens` in the whole trajectory (the
Dr.GRPO budget: the loss divides by N_w times this) and `max_total_tokens` after the prompt (the row's length T).
A turn cut by a trajectory limit ends the episode (its sampled prefix is kept: a prefix of a sample is a sample).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from drgrpo_jax.environments.chat import ChatRenderer
from drgrpo_jax.environments.protocol import Environment, Message
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.seeds import prompt_seeds, turn_seed

__all__ = ["EpisodeLimits", "Finish", "Trajectory", "TrajectoryRows", "episode_metrics", "run_episodes",
           "trajectory_arrays"]

COUNTED_COMPONENTS = ("turns", "tool_calls", "tool_errors", "malformed_calls")  # counts usable as rewards
Finish = Literal["done", "max_turns", "max_model_tokens", "max_total_tokens"]


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_turn_tokens: int = 256
    max_model_tokens: int = 512
    max_total_tokens: int = 1024

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EpisodeLimits.{field.name}: must be an int >= 1, got {value!r}")
        if self.max_model_tokens > self.max_total_tokens:
            raise ValueError(f"EpisodeLimits.max_model_tokens: {self.max_model_tokens} exceeds max_total_tokens "
                             f"{self.max_total_tokens}, which holds the model's tokens and the environment's")


@dataclasses.dataclass
class Trajectory:
    """One episode: `ids` after `prompt_ids`, `model_mask` True on the model's tokens, behaviour log-probs on
    those (0 elsewhere), the conversation as text (for logs and rewards) and the episode's counts."""

    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    model_mask: list[bool] = dataclasses.field(default_factory=list)
    behaviour_logprobs: list[float] = dataclasses.field(default_factory=list)
    messages: list[Message] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    tool_seconds: float = 0.0
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    finish: Finish | None = None
    weight_versions: list[str | None] = dataclasses.field(default_factory=list)

    @property
    def model_tokens(self) -> int:
        return sum(self.model_mask)

    def reward_component(self, name: str) -> float:
        """The episode's `name` (environment.reward_components): the sum of its turns' Observation.rewards[name],
        else its count of that name (turns, tool_calls, tool_errors, malformed_calls), else 0."""
        if name in self.rewards:
            return self.rewards[name]
        return float(getattr(self, name)) if name in COUNTED_COMPONENTS else 0.0

    @property
    def environment_tokens(self) -> int:
        return len(self.ids) - self.model_tokens

    @property
    def final_answer(self) -> str:
        """The last model turn's text."""
        return next((m["content"] for m in reversed(self.messages) if m.get("role") == "assistant"), "")

    def segments(self, tokenizer: Any) -> list[tuple[bool, str]]:
        """The trajectory after the prompt as runs of (the model wrote it, its text with special tokens): what the
        loss mask covers, for reading one episode."""
        runs = itertools.groupby(zip(self.model_mask, self.ids), key=lambda pair: pair[0])
        return [(model, tokenizer.decode([t for _, t in run])) for model, run in runs]

    def _append(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids += [int(t) for t in ids]
        self.model_mask += [model] * len(ids)
        self.behaviour_logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)


def run_episodes(client: RolloutClient, tokenizer: Any, make_environment: Callable[[], Environment],
                 examples: Sequence[Mapping[str, Any]], *, limits: EpisodeLimits, seed: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 renderer: Callable[[Environment], ChatRenderer] | None = None,
                 expected_version: str | int | None = None, max_staleness: int = 0,
                 first_episode: int = 0) -> list[Trajectory]:
    """One episode per example (repeat an example G times for a group), all advancing turn by turn together: each
    turn is one `client.generate` of every unfinished episode. Episode i's turn-t seed comes from (seed, t,
    first_episode + i) alone, so an episode is the same whichever episodes share its requests: a host sampling its
    share (`first_episode`: the index of examples[0] among all the rollout's episodes) or a chunk of an evaluation
    draws what one client sampling everything would. Every turn of an episode goes to the service its opening routes
    to, with the group's other episodes (`route_prefixes`): the one whose prefix cache holds their context. `renderer`:
    the environment's ChatRenderer (default: its tools, Hermes calls, the template's own tool rendering when it has
    one)."""
    make_renderer = renderer or (lambda env: ChatRenderer(tokenizer, env.tools))
    environments = [make_environment() for _ in examples]
    renderers = [make_renderer(env) for env in environments]
    trajectories = []
    for env, chat, example in zip(environments, renderers, examples):
        opening = env.reset(example)
        trajectories.append(Trajectory(prompt_ids=chat.opening_ids(opening), messages=list(opening)))
    eos = getattr(tokenizer, "eos_token_id", None)
    for turn in range(limits.max_turns):
        active = [i for i, t in enumerate(trajectories) if t.finish is None]
        if not active:
            break
        caps = {i: min(limits.max_turn_tokens, limits.max_model_tokens - trajectories[i].model_tokens,
                       limits.max_total_tokens - len(trajectories[i].ids)) for i in active}
        stops = sorted({s for s in (renderers[i].turn_stop_id for i in active) if s is not None}
                       | ({eos} if isinstance(eos, int) else set()))
        turn_seeds = prompt_seeds(turn_seed(seed, turn), len(trajectories), first_episode)
        sampled = client.generate([trajectories[i].prompt_ids + trajectories[i].ids for i in active], 1,
                                  max_new_tokens=max(caps.values()), temperature=temperature, top_p=top_p,
                                  top_k=top_k, stop_token_ids=stops, seeds=[turn_seeds[i] for i in active],
                                  expected_version=expected_version, max_staleness=max_staleness,
                                  route_prefixes=[trajectories[i].prompt_ids for i in active])
        for row, i in enumerate(active):
            trajectory, env, chat = trajectories[i], environments[i], renderers[i]
            length = int(sampled.lengths[row])
            kept = min(length, caps[i])
            out = sampled.response_ids[row, :kept].tolist()
            trajectory._append(out, True, sampled.behaviour_logprobs[row, :kept].tolist())
            trajectory.weight_versions.append(sampled.weight_versions[row])
            trajectory.turns += 1
            text = tokenizer.decode(out, skip_special_tokens=True)
            trajectory.messages.append({"role": "assistant", "content": text})
            if kept < length or kept == caps[i] < limits.max_turn_tokens:
                trajectory.finish = _limit_hit(trajectory, limits)
                continue
            observation = env.step(text)
            trajectory.tool_calls += observation.tool_calls
            trajectory.tool_errors += observation.tool_errors
            trajectory.malformed_calls += observation.malformed_calls
            trajectory.tool_seconds += observation.tool_seconds
            for name, value in observation.rewards.items():
                trajectory.rewards[name] = trajectory.rewards.get(name, 0.0) + float(value)
            if observation.done:
                trajectory.finish = "done"
                continue
            if trajectory.turns >= limits.max_turns:
                trajectory.finish = "max_turns"
                continue
            following = chat.continuation_ids(observation.messages, model_stopped=bool(out) and
                                              out[-1] == chat.turn_stop_id)
            if len(trajectory.ids) + len(following) >= limits.max_total_tokens:
                trajectory.finish = "max_total_tokens"  # no room left for a model token after it
                continue
            trajectory._append(following, False)
            trajectory.messages += list(observation.messages)
    for trajectory in trajectories:
        if trajectory.finish is None:
            trajectory.finish = "max_turns"
    return trajectories


def _limit_hit(trajectory: Trajectory, limits: EpisodeLimits) -> Finish:
    if trajectory.model_tokens >= limits.max_model_tokens:
        return "max_model_tokens"
    return "max_total_tokens"


@dataclasses.dataclass(frozen=True)
class TrajectoryRows:
    """Episodes as rows of a training batch, right-padded to T positions, under the rollout record's names."""

    response_ids: np.ndarray  # int32 [N, T]
    response_mask: np.ndarray  # bool [N, T]: every real token (the model reads them all)
    loss_mask: np.ndarray  # bool [N, T]: the model's tokens only
    behaviour_logprobs: np.ndarray  # float32 [N, T]: 0 off the model's tokens


def trajectory_arrays(trajectories: Sequence[Trajectory], length: int) -> TrajectoryRows:
    """The trajectories' rows, right-padded to `length` (the limits' max_total_tokens)."""
    rows = TrajectoryRows(response_ids=np.zeros((len(trajectories), length), np.int32),
                          response_mask=np.zeros((len(trajectories), length), bool),
                          loss_mask=np.zeros((len(trajectories), length), bool),
                          behaviour_logprobs=np.zeros((len(trajectories), length), np.float32))
    for r, trajectory in enumerate(trajectories):
        n = len(trajectory.ids)
        if n > length:
            raise ValueError(f"trajectory {r}: {n} tokens exceed the row length {length}")
        rows.response_ids[r, :n] = trajectory.ids
        rows.response_mask[r, :n] = True
        rows.loss_mask[r, :n] = trajectory.model_mask
        rows.behaviour_logprobs[r, :n] = trajectory.behaviour_logprobs
    return rows


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-trajectory means of a rollout's episodes (turns, tool calls and errors, malformed calls, tool seconds,
    model and environment tokens) and the share that ended on each limit."""
    if not trajectories:
        return {}
    n = len(trajectories)

    def mean(values) -> float:
        return float(sum(values)) / n

    metrics = {
        "episode/turns": mean(t.turns for t in trajectories),
        "episode/tool_calls": mean(t.tool_calls for t in trajectories),
        "episode/tool_errors": mean(t.tool_errors for t in trajectories),
        "episode/malformed_calls": mean(t.malformed_calls for t in trajectories),
        "episode/tool_seconds": mean(t.tool_seconds for t in trajectories),
        "episode/model_tokens": mean(t.model_tokens for t in trajectories),
        "episode/environment_tokens": mean(t.environment_tokens for t in trajectories),
    }
    for finish in ("done", "max_turns", "max_model_tokens", "max_total_tokens"):
        metrics[f"episode/finish_{finish}"] = mean(t.finish == finish for t in trajectories)
    return metrics
