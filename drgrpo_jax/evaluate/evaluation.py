"""Evaluation through the generation service: greedy and k sampled completions per problem, scored with the
training rewards, summarised as accuracy, avg@k and unbiased pass@k. One code path serves the trainer's
periodic evaluation (`train.eval_every`) and `python -m drgrpo_jax.evaluate`.

Shape letters (docs/shape_letters.md): P problems, G samples per problem, N = P * G completions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from drgrpo_jax.actor.actor import GroupSampling
from drgrpo_jax.evaluate.passk import sampled_report
from drgrpo_jax.rollout.record import correct_mask, response_stats

if TYPE_CHECKING:
    from drgrpo_jax.actor.actor import Actor
    from drgrpo_jax.data.examples import Example

__all__ = ["EvalSamples", "EvalSettings", "eval_metrics", "eval_summary", "evaluate_problems", "sample_and_score",
           "summarize"]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How each problem is answered: greedily once and/or `samples` times at `temperature`."""

    max_new_tokens: int
    samples: int = 0  # k completions per problem at `temperature` (0 = none: greedy only)
    temperature: float = 0.6
    top_p: float = 1.0
    greedy: bool = True  # also one greedy completion per problem (its accuracy is `accuracy`)
    seed: int = 0  # per-problem sampling seeds derive from it (and the problem's index)
    chunk_prompts: int = 64  # problems per request: the progress bar moves once per chunk

    def __post_init__(self):
        if self.samples < 0 or self.max_new_tokens < 1 or self.chunk_prompts < 1:
            raise ValueError(f"EvalSettings: samples >= 0, max_new_tokens >= 1 and chunk_prompts >= 1 needed, got "
                             f"{self.samples}, {self.max_new_tokens}, {self.chunk_prompts}")
        if self.samples and not (np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"EvalSettings.temperature: must be > 0 to sample, got {self.temperature}")
        if not (self.greedy or self.samples):
            raise ValueError("EvalSettings: neither greedy nor sampled completions asked for")


@dataclasses.dataclass(frozen=True)
class EvalSamples:
    """G scored completions of P problems, prompt-major (completion p * G + g)."""

    texts: tuple[str, ...]  # N decoded completions
    correct_PG: np.ndarray  # bool: full credit on a correctness reward (rollout_batch.correct_mask)
    reward_PG: np.ndarray  # float32: the weighted scalar reward
    lengths_PG: np.ndarray  # int: tokens generated
    truncated_PG: np.ndarray  # bool: hit max_new_tokens without a stop token

    def take(self, problems: Sequence[int]) -> EvalSamples:
        """The completions of these problems only (per-task reports of a mixed suite)."""
        group = self.correct_PG.shape[1]
        index = np.asarray(problems, int)
        return EvalSamples(tuple(self.texts[p * group + g] for p in index for g in range(group)),
                           self.correct_PG[index], self.reward_PG[index], self.lengths_PG[index],
                           self.truncated_PG[index])


def sample_and_score(actor: Actor, examples: Sequence[Example], prompts: Sequence[Sequence[int]], *, group: int,
                     temperature: float, settings: EvalSettings, expected_version: int | None = None,
                     progress: Callable[[int], Any] | None = None) -> EvalSamples:
    """`group` completions of each prompt at `temperature` (0 = greedy), decoded and scored, chunk by chunk.

    Seeds come from (settings.seed, problem index), so the samples do not depend on the chunk size (an episode's
    from (settings.seed, its turn, its index)). `progress(problems_done)` is called after each chunk.
    """
    sampling = GroupSampling(group=group, max_new_tokens=settings.max_new_tokens, temperature=temperature,
                        top_p=settings.top_p)
    texts: list[str] = []
    parts: list[tuple[np.ndarray, ...]] = []
    for start in range(0, len(prompts), settings.chunk_prompts):
        stop = min(start + settings.chunk_prompts, len(prompts))
        scored = actor.sample_and_score(examples[start:stop], prompts[start:stop], sampling, seed=settings.seed,
                                        expected_version=expected_version, prompt_offset=start)
        texts += scored.texts
        parts.append((correct_mask(scored.rewards.names, scored.rewards.components_NK), scored.rewards.total_N(),
                      scored.model_tokens, scored.truncated))
        if progress is not None:
            progress(stop - start)
    correct, reward, lengths, truncated = (np.concatenate(column).reshape(len(prompts), group)
                                           for column in zip(*parts))
    return EvalSamples(tuple(texts), correct.astype(bool), reward.astype(np.float32), lengths.astype(np.int64),
                       truncated.astype(bool))


def summarize(greedy: EvalSamples | None, sampled: EvalSamples | None) -> dict[str, Any]:
    """One flat report: greedy `accuracy`, lengths, truncation and reward; `avg@k`, `pass@k` and
    `sampled/...` lengths, truncation and reward of the k samples."""
    out: dict[str, Any] = {}
    if greedy is not None:
        greedy_stats = response_stats(greedy.lengths_PG[:, 0], greedy.truncated_PG[:, 0], greedy.correct_PG[:, 0])
        out.update(greedy_stats, reward_mean=float(greedy.reward_PG.mean()))
    if sampled is not None:
        sampled_stats = sampled_report(sampled.correct_PG, sampled.lengths_PG, sampled.truncated_PG)
        out.update({k: v for k, v in sampled_stats.items() if "@" in k})
        out.update({f"sampled/{k}": v for k, v in sampled_stats.items() if "@" not in k})
        out["sampled/reward_mean"] = float(sampled.reward_PG.mean())
    return out


def evaluate_problems(actor: Actor, examples: Sequence[Example], prompts: Sequence[Sequence[int]],
                      settings: EvalSettings, *, expected_version: int | None = None,
                      progress: Callable[[int], Any] | None = None) -> tuple[EvalSamples | None, EvalSamples | None]:
    """(greedy completions or None, sampled completions or None) of every problem, as `settings` asks."""
    score = functools.partial(sample_and_score, actor, examples, prompts, settings=settings,
                              expected_version=expected_version, progress=progress)
    greedy = score(group=1, temperature=0.0) if settings.greedy else None
    sampled = score(group=settings.samples, temperature=settings.temperature) if settings.samples else None
    return greedy, sampled


def eval_metrics(actor: Actor, examples: Sequence[Example], prompts: Sequence[Sequence[int]],
                 settings: EvalSettings, *, expected_version: int | None = None) -> dict[str, Any]:
    """The trainer's eval row: `eval/`-prefixed `summarize` of the held-out problems."""
    greedy, sampled = evaluate_problems(actor, examples, prompts, settings, expected_version=expected_version)
    return {"eval/num_prompts": len(examples), **{f"eval/{k}": v for k, v in summarize(greedy, sampled).items()}}


def eval_summary(row: dict[str, Any], prefix: str = "eval/") -> str:
    """One line: greedy accuracy, avg@k and the largest pass@k of a report (keys under `prefix`)."""
    parts = [f"accuracy {row[prefix + 'accuracy']:.3f}"] if row.get(prefix + "accuracy") is not None else []
    sampled = [k for k in row if k.startswith(prefix) and "@" in k]
    avg = [k for k in sampled if k.startswith(prefix + "avg@")]
    passes = sorted((k for k in sampled if k.startswith(prefix + "pass@")), key=lambda k: int(k.rpartition("@")[2]))
    parts += [f"{k[len(prefix):]} {row[k]:.3f}" for k in avg + passes[-1:]]
    return " ".join(parts)
