"""Independent float64 numpy oracles, written from the formulas in DESIGN.md with plain loops."""

from __future__ import annotations

import numpy as np


def _groups(rewards, valid):
    rewards = np.asarray(rewards, np.float64)
    valid = np.ones(rewards.shape[:2], bool) if valid is None else np.asarray(valid, bool)
    return rewards, valid


def dr_grpo(rewards, valid=None):
    rewards, valid = _groups(rewards, valid)
    out = np.zeros(rewards.shape[:2])
    for p in range(rewards.shape[0]):
        idx = np.flatnonzero(valid[p])
        if len(idx):
            out[p, idx] = rewards[p, idx] - rewards[p, idx].mean()
    return out


def grpo(rewards, valid=None, eps=1e-6):
    rewards, valid = _groups(rewards, valid)
    out = np.zeros(rewards.shape[:2])
    for p in range(rewards.shape[0]):
        idx = np.flatnonzero(valid[p])
        if len(idx) >= 2:
            r = rewards[p, idx]
            out[p, idx] = (r - r.mean()) / (r.std(ddof=1) + eps)
    return out


def rloo(rewards, valid=None):
    rewards, valid = _groups(rewards, valid)
    out = np.zeros(rewards.shape[:2])
    for p in range(rewards.shape[0]):
        idx = list(np.flatnonzero(valid[p]))
        if len(idx) >= 2:
            for i in idx:
                others = [rewards[p, j] for j in idx if j != i]
                out[p, i] = rewards[p, i] - np.mean(others)
    return out


def gdpo(components, weights, valid=None, eps=1e-4):
    components, valid = _groups(components, valid)
    P, G, K = components.shape
    combined = np.zeros((P, G))
    for p in range(P):
        idx = np.flatnonzero(valid[p])
        if len(idx) < 2:
            continue
        for k in range(K):
            c = components[p, idx, k]
            if c.max() > c.min():
                combined[p, idx] += weights[k] * (c - c.mean()) / (c.std(ddof=1) + eps)
    flat = combined[valid]
    out = np.zeros((P, G))
    if flat.size >= 2:
        out[valid] = (flat - flat.mean()) / (flat.std(ddof=1) + eps)
    return out


def token_losses(logprobs, old, adv, mask, clip_low, clip_high, kl_coef=0.0, ref=None, estimator="k3",
                 entropy_coef=0.0, entropy=None, dual_clip=None):
    """Per-token loss l_it in float64 (zero where masked)."""
    logprobs, old = np.asarray(logprobs, np.float64), np.asarray(old, np.float64)
    adv = np.asarray(adv, np.float64)
    adv = adv[:, None] * np.ones_like(logprobs) if adv.ndim == 1 else adv
    mask = np.asarray(mask, bool)
    out = np.zeros_like(logprobs)
    for i, t in zip(*np.nonzero(mask)):
        ratio = np.exp(logprobs[i, t] - old[i, t])
        a = adv[i, t]
        loss = -min(ratio * a, np.clip(ratio, 1 - clip_low, 1 + clip_high) * a)
        if dual_clip is not None and a < 0:
            loss = min(loss, -dual_clip * a)
        if ref is not None:
            d = float(ref[i, t]) - logprobs[i, t]
            kl = {"k1": -d, "k2": 0.5 * d * d, "k3": np.exp(d) - d - 1}[estimator]
            loss += kl_coef * kl
        if entropy is not None:
            loss -= entropy_coef * float(entropy[i, t])
        out[i, t] = loss
    return out


def aggregate(token_loss, mask, aggregation, budget=None, row_valid=None):
    """Window loss from per-token losses (float64)."""
    mask = np.asarray(mask, bool)
    row_valid = np.ones(mask.shape[0], bool) if row_valid is None else np.asarray(row_valid, bool)
    mask = mask & row_valid[:, None]
    n_valid = row_valid.sum()
    t_valid = mask.sum()
    if t_valid == 0:
        return 0.0
    total = (token_loss * mask).sum()
    if aggregation == "fixed_budget":
        return total / (n_valid * budget)
    if aggregation == "token_mean":
        return total / t_valid
    if aggregation == "seq_mean_token_sum":
        return total / n_valid
    per_seq = [(token_loss[i] * mask[i]).sum() / max(1, mask[i].sum()) for i in range(len(mask)) if row_valid[i]]
    return sum(per_seq) / n_valid


def policy_gradient(logprobs, old, adv, mask, clip_low, clip_high, policy_loss, row_valid=None):
    """(per-token policy-gradient loss, its gradient wrt logprobs per unit weight) in float64.

    The gradient is d l_it / d logprobs summed the way the aggregation sums it: for ppo_clip and
    cispo the token's own derivative; for gspo and gspo_token the derivative of row i's sequence
    term s_i = exp(mean_t log r_it) wrt logprob_it, times the row length (the row's value sits on
    each of its tokens and seq_mean_token_mean divides it by that length). On a clip bound the
    gradient flows (torch.clamp's convention).
    """
    logprobs, old = np.asarray(logprobs, np.float64), np.asarray(old, np.float64)
    adv = np.asarray(adv, np.float64)
    adv = adv[:, None] * np.ones_like(logprobs) if adv.ndim == 1 else adv
    mask = np.asarray(mask, bool)
    if row_valid is not None:
        mask = mask & np.asarray(row_valid, bool)[:, None]
    low, high = 1 - clip_low, 1 + clip_high
    loss, grad = np.zeros_like(logprobs), np.zeros_like(logprobs)
    for i in range(mask.shape[0]):
        idx = np.flatnonzero(mask[i])
        if not len(idx):
            continue
        seq = np.exp(np.mean(logprobs[i, idx] - old[i, idx]))
        for t in idx:
            a = adv[i, t]
            ratio = seq if policy_loss in ("gspo", "gspo_token") else np.exp(logprobs[i, t] - old[i, t])
            if policy_loss == "cispo":
                weight = min(max(ratio, low), high)
                loss[i, t], grad[i, t] = -weight * a, -weight * a
                continue
            loss[i, t] = -min(ratio * a, min(max(ratio, low), high) * a)
            flows = not ((ratio > high and a > 0) or (ratio < low and a < 0))
            grad[i, t] = -a * ratio if flows else 0.0
    return loss, grad


def aggregation_weights(mask, aggregation, budget=None):
    """d(window loss) / d(per-token loss) [N, T] in float64: the weight `aggregate` gives each token."""
    mask = np.asarray(mask, bool)
    n_valid, t_valid = mask.shape[0], mask.sum()
    weights = np.zeros(mask.shape)
    if t_valid == 0:
        return weights
    for i, t in zip(*np.nonzero(mask)):
        if aggregation == "fixed_budget":
            weights[i, t] = 1 / (n_valid * budget)
        elif aggregation == "token_mean":
            weights[i, t] = 1 / t_valid
        elif aggregation == "seq_mean_token_sum":
            weights[i, t] = 1 / n_valid
        else:
            weights[i, t] = 1 / (n_valid * mask[i].sum())
    return weights


def importance_oracle(mismatch, mask, level, tis_cap=None, mis_high=None, mis_low=0.0):
    """float64 weights per token from log(pi_old / pi_sampler), written from the formulas with loops."""
    mismatch, mask = np.asarray(mismatch, np.float64), np.asarray(mask, bool)
    out = np.ones_like(mismatch)
    for i, t in zip(*np.nonzero(mask)):
        ratio = np.exp(mismatch[i, mask[i]].sum() if level == "sequence" else mismatch[i, t])
        if tis_cap is not None:
            out[i, t] = min(ratio, tis_cap)
        elif mis_high is not None:
            out[i, t] = ratio if mis_low <= ratio <= mis_high else 0.0
    return out
