"""pass@k and avg@k against brute-force enumeration of every k-subset of the samples."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from drgrpo_jax.evaluate.passk import avg_at_k, pass_at_k, pass_at_k_P, report_ks, sampled_report


def brute_force_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """The exact fraction of k-subsets of the samples that hold at least one correct one."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    hits = sum(any(correct[i] for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("num_samples", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(num_samples):
    rng = np.random.default_rng(num_samples)
    for num_correct in range(num_samples + 1):
        correct = [True] * num_correct + [False] * (num_samples - num_correct)
        correct = list(rng.permutation(correct))  # the estimator must not depend on which samples are right
        for k in range(1, num_samples + 1):
            expected = brute_force_pass_at_k(correct, k)
            assert pass_at_k(num_samples, num_correct, k) == pytest.approx(float(expected), abs=1e-12), \
                (num_samples, num_correct, k)


def test_pass_at_k_edges_and_large_n_without_overflow():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 1, 8) == 1.0  # every 8-subset of 8 holds the one right sample
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)  # pass@1 is the fraction correct
    # C(1000, 100) is ~6e139: the product form never forms it, and matches the exact fraction.
    exact = 1 - math.prod(Fraction(990 - i, 1000 - i) for i in range(100))  # 1 - C(990, 100) / C(1000, 100)
    assert pass_at_k(1000, 10, 100) == pytest.approx(float(exact), rel=1e-9)
    for args, name in [((4, 1, 0), "k"), ((4, 1, 5), "k"), ((4, 5, 1), "num_correct"), ((4, -1, 1), "num_correct")]:
        with pytest.raises(ValueError, match=name):
            pass_at_k(*args)


def test_per_problem_pass_at_k_avg_at_k_and_the_report():
    correct_PG = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    np.testing.assert_allclose(pass_at_k_P(correct_PG, 2), [0.5, 1.0, 0.0])
    assert avg_at_k(correct_PG) == pytest.approx(5 / 12)
    assert report_ks(8) == [1, 2, 4, 8] and report_ks(6) == [1, 2, 4, 6] and report_ks(1) == [1]
    lengths_PG = np.array([[10, 20, 30, 40], [5, 5, 5, 5], [64, 64, 1, 1]])
    truncated_PG = lengths_PG == 64
    report = sampled_report(correct_PG, lengths_PG, truncated_PG)
    assert list(report)[:4] == ["avg@4", "pass@1", "pass@2", "pass@4"]
    assert report["pass@1"] == pytest.approx(report["avg@4"])  # the unbiased pass@1 is the mean correctness
    assert report["pass@4"] == pytest.approx(2 / 3)
    assert report["response_length_correct"] == pytest.approx((10 + 20) / 5)
    assert report["response_length_incorrect"] == pytest.approx((20 + 30 + 40 + 64 + 64 + 1 + 1) / 7)
    assert report["truncated_fraction"] == pytest.approx(2 / 12)
    none_right = sampled_report(np.zeros((2, 2), bool), np.ones((2, 2)), np.zeros((2, 2), bool))
    assert none_right["response_length_correct"] is None  # nothing to average: null, never a made-up 0
