"""The served weights' hot swap (`ServedWeights`) on its own, without a scheduler or HTTP: a LoRA adapter merges into
the base, never into the adapter merged before it; a full model becomes the next adapter's base; every generation
keeps the first one's graphdef (the compiled programs' key); a refused push leaves the served weights and the base
as they were. And the batch budget's `rows_that_fit`."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.errors import InvalidWeights
from drgrpo_jax.models.config import LoraSpec
from drgrpo_jax.models.hf_io import load_hf_config
from drgrpo_jax.models.lora import adapter_specs, save_adapter
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.serve.batch_budget import BatchBudget
from drgrpo_jax.serve.weight_swap import ServedWeights
from drgrpo_jax.serve.weights import Weights

from support.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two versions of a tiny Llama and a LoRA adapter on it (B nonzero, so merging changes the weights)."""
    root = tmp_path_factory.mktemp("swap")
    v0, v1 = write_tiny_llama(str(root / "v0"), seed=0), write_tiny_llama(str(root / "v1"), seed=1)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    rng = np.random.default_rng(0)
    arrays = {name: rng.normal(0, 0.3, shape).astype(np.float32)
              for name, (shape, _) in adapter_specs(load_hf_config(v0), spec).items()}
    save_adapter(arrays, spec, str(root / "adapter"), base_model=v0)
    return {"v0": v0, "v1": v1, "adapter": str(root / "adapter")}


def _same(a: Weights, b: Weights) -> bool:
    """Whether two generations hold equal parameters."""
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True))


def test_an_adapter_merges_into_the_base_and_a_model_push_becomes_the_base(folders):
    served = ServedWeights(ServeConfig(model=folders["v0"]), None)
    v0 = served.base
    once = served.load_folder(folders["adapter"], "1")
    assert once.adapter is not None and not _same(once, v0) and _same(served.base, v0) and served.current is once
    twice = served.load_folder(folders["adapter"], "2")
    assert twice.version == "2" and _same(twice, once)  # merged into v0 again, not into version 1's weights
    model = served.load_folder(folders["v1"], "3")
    assert model.adapter is None and _same(served.base, model) and not _same(model, v0)
    on_v1 = served.load_folder(folders["adapter"], "4")
    assert not _same(on_v1, once)  # the adapter now merges into v1
    assert all(w.graphdef is v0.graphdef for w in (once, twice, model, on_v1, served.base))


def test_a_refused_push_leaves_the_weights_and_the_base_as_they_were(folders, tmp_path):
    served = ServedWeights(ServeConfig(model=folders["v0"], weight_version="5"), None)
    current, base = served.current, served.base
    refused = [(lambda: served.load_folder(str(tmp_path / "missing"), "6"), "model_path: not a valid model folder"),
               (lambda: served.load_folder(folders["v1"], "4"), "weight_version: 4 is older than the served version 5"),
               (lambda: served.load_segment("drgrpo_weights_1_abcdefgh/v6_0123456789abcdef", [], "6"),
                "segment: no such shared-memory segment")]
    for push, message in refused:
        with pytest.raises(InvalidWeights, match=message):
            push()
        assert served.current is current and served.base is base
    assert served.load_folder(folders["v1"], "4", allow_rollback=True).version == "4"  # a resumed trainer's push


def test_rows_that_fit_stop_before_the_row_that_would_pass_the_limit(folders):
    model = load_hf_config(folders["v0"])
    row = RowRequest(tuple(range(3, 40)), SamplingParams(max_new_tokens=50), seed=0)
    probe = BatchBudget.of(ServeConfig(model=folders["v0"], max_batch_bytes=1, max_batch_size=8), model, None)
    four = BatchBudget.of(ServeConfig(model=folders["v0"], max_batch_bytes=probe.batch_bytes(4, 37, 50),
                                      max_batch_size=8), model, None)
    assert four.batch_bytes(4, 37, 50) < four.batch_bytes(5, 37, 50)  # rows are bucketed: 3 and 4 take the same
    assert four.rows_that_fit([row] * 6) == 4
    assert probe.rows_that_fit([row] * 5) == 1  # one row always: the request's check refused any too large alone
    assert four.rows_that_fit([]) == 0
    assert BatchBudget.of(ServeConfig(model=folders["v0"], max_batch_size=2), model, None).rows_that_fit([row] * 5) == 2
