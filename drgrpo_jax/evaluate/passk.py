"""Sampled-evaluation statistics: avg@k and the unbiased pass@k estimator (pure numpy).

Shape letters (docs/shape_letters.md): P problems, G samples per problem.

pass@k is the probability that at least one of k completions drawn without replacement from a
problem's n samples is correct, averaged over problems (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", eq. 1); avg@k is the mean correctness of all n samples (pass@1's estimate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["avg_at_k", "pass_at_k", "pass_at_k_P", "report_ks", "sampled_report"]


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem with `num_correct` of `num_samples` completions correct.

    `1 - C(n - c, k) / C(n, k)` for c correct of n, computed as the product `1 - prod_{i = n - c + 1}^{n} (1 - k / i)`,
    which never forms the huge binomials.
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"k: must be in [1, num_samples = {num_samples}], got {k}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct: must be in [0, {num_samples}], got {num_correct}")
    if num_samples - num_correct < k:  # every k-subset holds a correct completion
        return 1.0
    factors = 1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1, dtype=np.float64)
    return float(1.0 - np.prod(factors))


def pass_at_k_P(correct_PG: np.ndarray, k: int) -> np.ndarray:
    """float64 [P]: each problem's unbiased pass@k from its G samples."""
    correct_PG = np.asarray(correct_PG, bool)
    num_samples = correct_PG.shape[1]
    return np.asarray([pass_at_k(num_samples, int(c), k) for c in correct_PG.sum(axis=1)], np.float64)


def avg_at_k(correct_PG: np.ndarray) -> float:
    """Mean correctness over every sample of every problem."""
    return float(np.asarray(correct_PG, np.float64).mean())


def report_ks(num_samples: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(num_samples.bit_length()) if 1 << i <= num_samples]
    return ks if ks[-1] == num_samples else [*ks, num_samples]


def _mean_or_none(values: np.ndarray) -> float | None:
    """The mean, or None (JSON null) when there is nothing to average: never a made-up 0."""
    return float(values.mean()) if values.size else None


def sampled_report(correct_PG: np.ndarray, lengths_PG: np.ndarray, truncated_PG: np.ndarray,
                   ks: Sequence[int] | None = None) -> dict[str, float | None]:
    """avg@n, pass@k for each k, and response lengths (correct / incorrect) and truncation over all samples."""
    correct_PG = np.asarray(correct_PG, bool)
    lengths_PG = np.asarray(lengths_PG, np.float64)
    num_samples = correct_PG.shape[1]
    out: dict[str, float | None] = {f"avg@{num_samples}": avg_at_k(correct_PG)}
    for k in ks or report_ks(num_samples):
        out[f"pass@{k}"] = float(pass_at_k_P(correct_PG, k).mean())
    out["response_length_mean"] = float(lengths_PG.mean())
    out["response_length_correct"] = _mean_or_none(lengths_PG[correct_PG])
    out["response_length_incorrect"] = _mean_or_none(lengths_PG[~correct_PG])
    out["truncated_fraction"] = float(np.asarray(truncated_PG, np.float64).mean())
    return out
