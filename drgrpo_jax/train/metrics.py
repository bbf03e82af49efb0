"""metrics.jsonl's row of a training step and samples.jsonl's rows: what the host loop logs (train/loop.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from drgrpo_jax.config.derived import component_names, reward_weights
from drgrpo_jax.config.schema import Config
from drgrpo_jax.rollout.record import EPISODE_COLUMNS, HostCounters, ScoredRollout, correct_mask, response_stats
from drgrpo_jax.step.metrics import StepMetrics

if TYPE_CHECKING:
    from drgrpo_jax.step.batch import Batch

__all__ = ["UpdateResult", "sample_rows", "staleness_metrics", "step_metrics", "windows_mean"]


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """What the step's optimizer updates report."""

    history: list[StepMetrics]  # one per update (optimizer window), host values (after jax.device_get)
    window_reports: list[dict[str, float]]  # one per window: what its algorithm's window step reports
    old_logprob_seconds: float = 0.0  # the old-logprob forward over the rollout (0: skipped, on-policy)


def step_metrics(config: Config, step: int, rollout: ScoredRollout, batch: Batch, counters: HostCounters,
                 updates: UpdateResult, seconds: dict[str, float]) -> dict[str, Any]:
    """metrics.jsonl's row for step `step` (1-based): losses, rewards, lengths, staleness, throughput, seconds.

    Throughput: tokens_per_second = generated tokens / whole step time; rollout_tokens_per_second = generated
    tokens / rollout time; train_tokens_per_second = (prompt + response) tokens x ppo_epochs / train time.
    """
    names, valid = component_names(config.reward), rollout.row_valid
    components = rollout.components[valid]  # the trained responses (padding groups left out)
    total = components @ np.asarray(reward_weights(config), np.float32)
    generated, oldest = int(rollout.lengths.sum()), rollout.weight_versions.min()
    trained = int(batch.prompt_mask[valid].sum() + batch.response_mask[valid].sum()) * config.algorithm.ppo_epochs
    row: dict[str, Any] = {
        "step": step, **windows_mean(updates.history).row(),
        "grad_norm_max": max(float(metrics.grad_norm) for metrics in updates.history),
        "reward_mean": float(total.mean()), "reward_std": float(total.std()),
        **response_stats(rollout.lengths[valid], rollout.truncated[valid], correct_mask(names, components)),
        "advantage_abs_mean": float(np.abs(batch.advantages[valid]).mean()),
        "weight_version": int(oldest), "staleness": int(step - 1 - oldest),
        "tokens_per_second": generated / seconds["step"],
        "rollout_tokens_per_second": generated / max(counters.rollout_seconds, 1e-9),
        "train_tokens_per_second": trained / seconds["train"],
        "rollout_seconds": counters.rollout_seconds, "reward_seconds": counters.reward_seconds,
        "train_seconds": seconds["train"], "old_logprob_seconds": updates.old_logprob_seconds,
        "push_seconds": seconds["push"], "step_seconds": seconds["step"],
        "rollout_wait_seconds": seconds["wait"]}  # rollout.async: the wait for the next round after the update
    row.update(staleness_metrics(step - 1, rollout, config.rollout.max_staleness))
    for key in updates.window_reports[0]:  # the window step's report (gdpo: whitening), averaged over windows
        row[key] = float(np.mean([report[key] for report in updates.window_reports]))
    row.update({f"reward/{name}": float(components[:, k].mean()) for k, name in enumerate(names)})
    if config.environment.enabled:  # multi-turn episodes: per-trajectory means of their counts
        episodes = np.asarray(rollout.episodes)[valid]  # None (JSON null) when every group is padding
        row.update({f"episode/{column}": float(episodes[:, k].mean()) if len(episodes) else None
                    for k, column in enumerate(EPISODE_COLUMNS)})
    return row | counters.metrics()


def windows_mean(history: Sequence[StepMetrics]) -> StepMetrics:
    """The windows' metrics averaged field by field in float64 (a mixture's per-layer loads layer by layer)."""
    return jax.tree.map(lambda *values: np.mean(np.asarray(values, np.float64), axis=0), *history)


def staleness_metrics(version: int, rollout: ScoredRollout, max_staleness: int) -> dict[str, float]:
    """How old the rollout is for the policy `version` trained on it: its groups' staleness (a group's oldest
    completion) min, mean and max and its histogram (the share of groups 0..max_staleness versions back), the share
    of generated tokens sampled 0..max_staleness versions back, and the share of responses an in-flight weight
    update reached while they decoded (their tokens carry more than one version)."""
    groups = version - rollout.weight_versions.reshape(-1, rollout.group_size).min(axis=1)
    # Each token's own version: a response that crossed an in-flight weight update counts at both.
    versions, mask = np.asarray(rollout.token_versions), rollout.response_mask
    sampled = versions[mask]
    lags, tokens = version - sampled, np.ones(len(sampled))
    total = max(float(tokens.sum()), 1.0)
    newest = np.where(mask, versions, np.iinfo(versions.dtype).min).max(axis=1)
    oldest = np.where(mask, versions, np.iinfo(versions.dtype).max).min(axis=1)
    return {"staleness_min": int(groups.min()), "staleness_mean": float(groups.mean()),
            "staleness_max": int(groups.max()),
            **{f"groups_at_staleness/{k}": float(np.mean(groups == k)) for k in range(max_staleness + 1)},
            **{f"tokens_at_staleness/{k}": float(tokens[lags == k].sum() / total) for k in range(max_staleness + 1)},
            "responses_crossing_update": float(np.mean(newest > oldest))}


def sample_rows(config: Config, tokenizer: Any, step: int, rollout: ScoredRollout) -> list[dict[str, Any]]:
    """samples.jsonl rows: every completion of the step's first two prompts (decoded here: any host sampled them)."""
    rows, group = [], rollout.group_size
    names = component_names(config.reward)
    total = rollout.components @ np.asarray(reward_weights(config), np.float32)
    for p, example in enumerate(rollout.examples[:2]):
        picked = range(p * group, (p + 1) * group)
        texts = tokenizer.batch_decode([rollout.response_ids[i][:rollout.lengths[i]] for i in picked],
                                           skip_special_tokens=True)
        for i, text in zip(picked, texts):
            rows.append({"step": step, "prompt_id": example.prompt_id, "question": example.question,
                         "answer": example.answer, "completion": text, "reward": float(total[i]),
                         **{f"reward/{n}": float(rollout.components[i, k]) for k, n in enumerate(names)},
                         "length": int(rollout.lengths[i]), "truncated": bool(rollout.truncated[i])})
    return rows


