"""Issue #56: in-flight weight updates (--inflight-updates). A weight push that lands while a batch decodes reaches it
at its next phase boundary or --cancel-check-steps pause: the tokens from there are sampled by the new version over
the KV cache the old one wrote, and each token reports its version. The push is made from the batch's own boundary
hook (its second question), so the switch column is known: tokens 0-4 by version 0, the rest by version 1. With the
flag off the batch finishes on the version it started on (the service's behaviour before)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient
from flax import nnx

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.models.logprobs import sequence_logprobs
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sampler.programs import compiled_programs
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import RowResult, Scheduler

from support.full_cache_sampler import full_cache_sample
from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.heavy  # two engines compile the sampler's programs

EVERY = 4  # --cancel-check-steps: the batch asks before its phase (step 1), then at steps 5, 9, ...
SWITCH = 1 + EVERY  # the second question: the first token the pushed weights sample
ROW = RowRequest((5, 9), SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True), seed=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("inflight")
    return write_tiny_llama(str(root / "v0"), seed=0), write_tiny_llama(str(root / "v1"), seed=1)


def _scheduler(model: str, inflight: bool) -> Scheduler:
    return Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0, cancel_check_steps=EVERY,
                              inflight_updates=inflight))


def _push_at_second_question(scheduler: Scheduler, folder: str) -> None:
    """The scheduler's next batches load `folder` as version 1 when the sampler asks its second question."""
    real = scheduler.run_batch

    def pushes(weights, rows, unwanted):
        questions = []

        def asked() -> list[bool]:
            questions.append(1)
            if len(questions) == 2:
                scheduler.served.load_folder(folder, "1")
            return unwanted()

        return real(weights, rows, unwanted=asked)

    scheduler.run_batch = pushes  # type: ignore[method-assign]


def _sample(scheduler: Scheduler) -> RowResult:
    (result,) = scheduler.submit([ROW]).result(timeout=300)
    return result


def _oracle(folders, switch: bool) -> dict[str, np.ndarray]:
    """The full-cache sampler on the same row: version 0 throughout, or version 1 from SWITCH over v0's cache."""
    old, new = (from_pretrained(folder) for folder in folders)
    batch = make_batch([ROW], old.config.eos_token_ids, batch_size=1, prompt_len=16, num_prompts=1)
    return full_cache_sample(old, batch, 32, switch=(SWITCH, new) if switch else None)


def test_a_push_reaches_the_running_batch_at_its_next_boundary(folders):
    scheduler = _scheduler(folders[0], inflight=True)
    try:
        plain = _sample(scheduler)  # compiles the batch's programs
        assert plain.token_versions == ["0"] * 24 and plain.weight_version == "0"
        programs = compiled_programs()
        _push_at_second_question(scheduler, folders[1])
        crossed = _sample(scheduler)
        assert compiled_programs() == programs  # the new weights are arguments of the same programs
        assert crossed.token_versions == ["0"] * SWITCH + ["1"] * (24 - SWITCH)
        assert crossed.weight_version == "0"  # the oldest version of the row
        assert scheduler.weights.version == "1" and _sample(scheduler).token_versions == ["1"] * 24
    finally:
        scheduler.close()
    # Before the switch: version 0's tokens and log-probs; from it: version 1's over the cache version 0 wrote.
    assert crossed.output_ids[:SWITCH] == plain.output_ids[:SWITCH]
    np.testing.assert_array_equal(crossed.logprobs[:SWITCH], plain.logprobs[:SWITCH])
    oracle = _oracle(folders, switch=True)
    assert crossed.output_ids == oracle["tokens"][0, :24].tolist()
    np.testing.assert_allclose(crossed.logprobs, oracle["logprobs"][0, :24], atol=1e-4)
    assert not np.allclose(crossed.logprobs[SWITCH:], _oracle(folders, switch=False)["logprobs"][0, SWITCH:24],
                           atol=1e-2)  # version 1 did sample them
    # Version 1 recomputing the whole sequence (a fresh cache) would give other log-probs: the cache is stale.
    ids = jnp.asarray([list(ROW.prompt_ids) + crossed.output_ids], jnp.int32)
    fresh_BT, _ = jax.jit(sequence_logprobs)(from_pretrained(folders[1]), ids[:, :-1], ids[:, 1:])
    assert not np.allclose(crossed.logprobs[SWITCH:], np.asarray(fresh_BT)[0, len(ROW.prompt_ids) - 1 + SWITCH:],
                           atol=1e-3)


def test_without_the_flag_a_batch_finishes_on_its_version(folders):
    scheduler = _scheduler(folders[0], inflight=False)
    try:
        plain = _sample(scheduler)
        _push_at_second_question(scheduler, folders[1])
        crossed = _sample(scheduler)
        after = _sample(scheduler)
    finally:
        scheduler.close()
    assert crossed.token_versions is None and crossed.weight_version == "0"
    assert (crossed.output_ids, crossed.logprobs) == (plain.output_ids, plain.logprobs)
    assert after.weight_version == "1"


def test_generate_answers_each_tokens_version_only_with_the_flag(folders):
    for inflight in (True, False):
        scheduler = _scheduler(folders[0], inflight=inflight)
        try:
            client = TestClient(build_app(scheduler, None), base_url="http://localhost")
            _push_at_second_question(scheduler, folders[1])
            answer = client.post("/generate", json={"input_ids": list(ROW.prompt_ids), "return_logprob": True,
                                                    "sampling_params": {"max_new_tokens": 24, "ignore_eos": True,
                                                                        "sampling_seed": 1}}).json()
        finally:
            scheduler.close()
        meta = answer["meta_info"]
        assert meta["weight_version"] == "0" and len(meta["output_token_logprobs"]) == 24
        if inflight:
            assert meta["output_token_weight_versions"] == ["0"] * SWITCH + ["1"] * (24 - SWITCH)
        else:
            assert "output_token_weight_versions" not in meta


def test_the_sampler_refuses_weights_of_other_shapes_or_dtypes(folders):
    model = from_pretrained(folders[0])
    graphdef, state = nnx.split(model)
    batch = make_batch([ROW], model.config.eos_token_ids, batch_size=1, prompt_len=16, num_prompts=1)
    other = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
    with pytest.raises(ValueError, match="^weights_now: a weight of shape/dtype .* bfloat16 replaces"):
        generate(graphdef, state, batch, max_new_tokens=32, check_every=EVERY,
                 weights_now=lambda: (other, 1))
