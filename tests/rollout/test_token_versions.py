"""Issue #56: the client's record of which weight version sampled each token (`Completions.token_versions`), read
from a service with --inflight-updates (`meta_info.output_token_weight_versions`), and the staleness bound checked on
every token, not only on the row's version."""

import httpx
import numpy as np
import pytest

from drgrpo_jax.errors import RolloutError, StaleWeightsError
from drgrpo_jax.rollout.client import RolloutClient


def _answer(rows: list[tuple[list[int], str, list | None]]) -> httpx.MockTransport:
    """A service answering every /generate with `rows`: (output ids, weight_version, per-token versions or None)."""
    items = []
    for ids, version, per_token in rows:
        meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids], "weight_version": version,
                "finish_reason": {"type": "length", "length": len(ids)}}
        if per_token is not None:
            meta["output_token_weight_versions"] = per_token
        items.append({"output_ids": ids, "meta_info": meta})
    return httpx.MockTransport(lambda request: httpx.Response(200, json=items))


def _generate(transport: httpx.MockTransport, **kwargs):
    with RolloutClient(["http://a"], transport=transport, backoff_s=0.0) as client:
        return client.generate([[1, 2]], 2, max_new_tokens=5, seed=0, **kwargs)


def test_each_tokens_version_is_read_and_padding_is_minus_one():
    sampled = _generate(_answer([([7, 8, 9, 10], "3", ["3", "3", "4", "4"]), ([7, 8], "4", None)]))
    assert sampled.token_versions.dtype == np.int32
    np.testing.assert_array_equal(sampled.token_versions, [[3, 3, 4, 4, -1], [4, 4, -1, -1, -1]])
    assert sampled.weight_versions == ("3", "4")


def test_a_version_that_is_not_an_integer_is_the_rows_own():
    sampled = _generate(_answer([([7, 8], "base", None), ([7], "base", ["base"])]))
    np.testing.assert_array_equal(sampled.token_versions, -np.ones((2, 5)))
    with pytest.raises(RolloutError, match=r"\[1\]\.meta_info\.output_token_weight_versions\[0\]: 'next' is neither"):
        _generate(_answer([([7], "base", None), ([7], "base", ["next"])]))
    with pytest.raises(RolloutError, match=r"\[0\]\.meta_info\.output_token_weight_versions: not a list of one"):
        _generate(_answer([([7, 8], "3", ["3"]), ([7], "3", None)]))


def test_the_staleness_bound_holds_for_every_token():
    """A row whose own version is fresh but whose later tokens come from a version the trainer has not reached, or
    whose earlier tokens are too old, is refused."""
    rows = [([7, 8, 9], "5", ["5", "5", "6"]), ([7], "6", None)]
    assert _generate(_answer(rows), expected_version=6, max_staleness=1).token_versions[0, 2] == 6
    with pytest.raises(StaleWeightsError, match="got '6', expected '5'"):
        _generate(_answer(rows), expected_version=5, max_staleness=1)
    with pytest.raises(StaleWeightsError, match="got '4', expected '6'"):
        _generate(_answer([([7, 8], "6", ["4", "6"]), ([7], "6", None)]), expected_version=6, max_staleness=1)
