"""The KV-cache sampler against repeated full forwards, the trainer's log-probs, and numpy oracles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.logprobs import sequence_logprobs
from drgrpo_jax.sampler import draws
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, batch_bucket, bucket, make_batch
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sampler.programs import compiled_programs

from support.tiny_models import tiny_sampler_model

pytestmark = pytest.mark.heavy  # the sampler compiled per batch shape and filter

PROMPTS = ((5, 17, 3), (40, 2, 9, 11, 60, 7, 8), (1,))


@pytest.fixture(scope="module")
def model():
    return tiny_sampler_model()


def run(model, rows, *, batch_size=4):
    """Samples `rows` in a [4, 16] batch with 16 new tokens (one shape, so the file compiles once)."""
    batch = make_batch(rows, model.config.eos_token_ids, batch_size=batch_size, prompt_len=16)
    graphdef, state = nnx.split(model)
    return jax.tree.map(np.asarray, generate(graphdef, state, batch, max_new_tokens=16))


@jax.jit
def _forward(model, ids_BT):
    return model(ids_BT)


def _padded(ids) -> np.ndarray:
    """One unpadded sequence right-padded to [1, 32] (the model is causal: padding after it changes nothing)."""
    padded = np.zeros((1, 32), np.int32)
    padded[0, :len(ids)] = ids
    return padded


def forward(model, ids):
    """Logits [T, V] of one unpadded sequence, right-padded to 32 so every length shares a program; padding and
    slicing in numpy, so no length compiles an operation of its own."""
    return np.asarray(_forward(model, _padded(ids)))[0, :len(ids)]


@jax.jit
def _forward_logprobs(model, ids_BT, temperature):
    return jax.nn.log_softmax(model(ids_BT) / temperature, -1)


def full_forward_logprobs(model, prompt, completion, temperature):
    """log softmax(logits / temperature) of each completion token from one unpadded full forward (per position,
    so computed over the padded window in one program and sliced after)."""
    ids = list(prompt) + list(completion)
    logprobs_TV = np.asarray(_forward_logprobs(model, _padded(ids), temperature))[0, len(prompt) - 1:len(ids) - 1]
    return np.take_along_axis(logprobs_TV, np.asarray(completion)[:, None], -1)[:, 0]


@jax.jit
def _sequence_logprobs(model, input_ids_BT, targets_BT, temperature):
    """The trainer's log-probs, one program per length (eagerly, each of its operations is one)."""
    return sequence_logprobs(model, input_ids_BT, targets_BT, temperature=temperature)


def test_greedy_equals_argmax_of_repeated_full_forwards(model):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    out = run(model, [RowRequest(p, params, seed=0) for p in PROMPTS])
    for b, prompt in enumerate(PROMPTS):
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(np.argmax(forward(model, ids)[-1])))
        np.testing.assert_array_equal(out.tokens_BT[b, :12], ids[len(prompt):])
        assert out.lengths_B[b] == 12 and not out.stopped_B[b]
    assert len(set(map(tuple, out.tokens_BT[:3, :12].tolist()))) == 3  # the rows really differ


def test_prefill_then_decode_logits_equal_full_forward(model):
    """The sampler's cache use (left-padded prefill of U-1 columns, then one token at a time); one row per prompt."""
    rows = [RowRequest(p, SamplingParams(), seed=0) for p in PROMPTS]
    batch = make_batch(rows, (), batch_size=4, prompt_len=8)
    completion = np.asarray([[3, 14, 15], [92, 65, 35], [89, 79, 32], [0, 0, 0]], np.int32)
    decode = jax.jit(lambda m, ids, pos, cache: m.decode(ids, pos, cache))
    cache = init_cache(model.config, 4, 8 + 3)
    _, cache = decode(model, batch.prompt_ids_PU[:, :-1], batch.prompt_positions_PU[:, :-1], cache)
    step_logits = []
    logits, cache = decode(model, batch.prompt_ids_PU[:, -1:], batch.prompt_positions_PU[:, -1:], cache)
    step_logits.append(logits[:, 0])
    for t in range(3):
        positions = (batch.prompt_positions_PU.max(axis=1) + 1 + t)[:, None]
        logits, cache = decode(model, jnp.asarray(completion[:, t:t + 1]), positions, cache)
        step_logits.append(logits[:, 0])
    for b, prompt in enumerate(PROMPTS):
        full = forward(model, list(prompt) + completion[b].tolist())[len(prompt) - 1:]
        np.testing.assert_allclose(np.stack([s[b] for s in step_logits]), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sampled_logprobs_equal_trainer_logprobs(model, temperature, top_k, top_p):
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, ignore_eos=True)
    out = run(model, [RowRequest(p, params, seed=3, sample=i) for i, p in enumerate(PROMPTS)])
    for b, prompt in enumerate(PROMPTS):
        completion = out.tokens_BT[b, :out.lengths_B[b]]
        ids = jnp.asarray([list(prompt) + completion.tolist()], jnp.int32)
        trainer_BT, _ = _sequence_logprobs(model, ids[:, :-1], ids[:, 1:], temperature)
        np.testing.assert_allclose(out.logprobs_BT[b, :len(completion)], trainer_BT[0, len(prompt) - 1:], atol=1e-4)
        np.testing.assert_allclose(out.logprobs_BT[b, :len(completion)],
                                   full_forward_logprobs(model, prompt, completion, temperature), atol=1e-4)


def test_fixed_seed_repeats_and_rows_do_not_depend_on_batch_mates(model):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    rows = [RowRequest(PROMPTS[0], params, seed=7, sample=s) for s in range(4)]
    first, again = run(model, rows), run(model, rows)
    np.testing.assert_array_equal(first.tokens_BT, again.tokens_BT)
    assert len({tuple(t) for t in first.tokens_BT.tolist()}) == 4  # samples of one prompt differ
    other_seed = run(model, [RowRequest(PROMPTS[0], params, seed=8, sample=0)] + rows[1:])
    assert not np.array_equal(other_seed.tokens_BT[0], first.tokens_BT[0])
    np.testing.assert_array_equal(other_seed.tokens_BT[1:], first.tokens_BT[1:])
    mixed = run(model, [rows[2], RowRequest(PROMPTS[1], params, seed=99), rows[0]])
    np.testing.assert_array_equal(mixed.tokens_BT[0], first.tokens_BT[2])
    np.testing.assert_array_equal(mixed.tokens_BT[2], first.tokens_BT[0])
    # A greedy batch-mate changes neither the sampled rows nor its own tokens (the argmax runs only with one).
    greedy = RowRequest(PROMPTS[1], dataclasses.replace(params, temperature=0.0), seed=0)
    with_greedy, greedy_alone = run(model, [rows[0], greedy]), run(model, [greedy])
    np.testing.assert_array_equal(with_greedy.tokens_BT[0], first.tokens_BT[0])
    np.testing.assert_array_equal(with_greedy.tokens_BT[1], greedy_alone.tokens_BT[0])


def test_stop_tokens_budgets_and_early_exit(model):
    greedy = run(model, [RowRequest(PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                ignore_eos=True), seed=0)])
    stop_at = int(greedy.tokens_BT[0, 2])  # greedy will emit this token third (or earlier)
    first = int(np.argmax(greedy.tokens_BT[0] == stop_at))
    rows = [RowRequest(PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop_at,),
                                                  ignore_eos=True), seed=0),
            RowRequest(PROMPTS[1], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True), seed=0)]
    out = run(model, rows)
    assert out.stopped_B.tolist() == [True, False, False, False]
    assert out.lengths_B.tolist() == [first + 1, 2, 0, 0]
    np.testing.assert_array_equal(out.tokens_BT[0, :first + 1], greedy.tokens_BT[0, :first + 1])
    assert (out.tokens_BT[0, first + 1:] == 0).all() and (out.logprobs_BT[0, first + 1:] == 0).all()
    assert (out.tokens_BT[1, 2:] == 0).all()
    assert out.num_steps == first  # the loop ended when the last row finished, not at the budget of 16


def test_eos_from_config_stops_unless_ignored(model):
    greedy = run(model, [RowRequest(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                ignore_eos=True), seed=0)])
    first = int(greedy.tokens_BT[0, 0])
    config = model.config
    rows = [RowRequest(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0), seed=0)]
    batch = make_batch(rows, (first,), batch_size=4, prompt_len=16)
    out = generate(*nnx.split(model), batch, max_new_tokens=16)
    assert int(out.lengths_B[0]) == 1 and bool(out.stopped_B[0]) and config.eos_token_ids != (first,)


def test_zero_budget_rows_and_padding_rows_generate_nothing(model):
    out = run(model, [RowRequest(PROMPTS[0], SamplingParams(max_new_tokens=0), seed=0)])
    assert out.lengths_B.tolist() == [0, 0, 0, 0] and (out.tokens_BT == 0).all() and out.num_steps == 0


def test_inverse_cdf_draws_follow_the_distribution():
    logits_V = jnp.asarray([2.0, -jnp.inf, 0.5, 1.0, -1.0] + [-jnp.inf] * 300 + [1.5])  # spans two CDF chunks
    probs = np.asarray(jax.nn.softmax(logits_V))
    num = 40_000
    uniform = jax.random.uniform(jax.random.key(0), (num,))
    tokens = np.asarray(draws.sample_inverse_cdf(jnp.broadcast_to(logits_V, (num, logits_V.shape[0])), uniform))
    counts = np.bincount(tokens, minlength=logits_V.shape[0])
    assert counts[probs == 0].sum() == 0
    expected = probs * num
    nz = probs > 0
    # 5 standard deviations of a binomial count: fails on a biased sampler, not on noise.
    assert (np.abs(counts[nz] - expected[nz]) < 5 * np.sqrt(expected[nz] * (1 - probs[nz]))).all()


def test_inverse_cdf_edges_pick_first_and_last_nonzero_tokens():
    logits_BV = jnp.asarray([[0.0, 0.0, -jnp.inf, 0.0, -jnp.inf]] * 2)
    tokens = draws.sample_inverse_cdf(logits_BV, jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0))]))
    assert tokens.tolist() == [0, 3]


def reference_filter(logits_V: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Sort-based top-k then top-p (the HF warpers' order), as a numpy oracle."""
    out = logits_V.copy()
    if top_k > 0:
        out[out < np.sort(out)[::-1][min(top_k, out.size) - 1]] = -np.inf
    probs = np.exp(out.astype(np.float64) - out.max())
    probs /= probs.sum()
    order = np.argsort(-out, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros_like(out, bool)
    keep[order[mass_before < top_p]] = True
    return np.where(keep, out, -np.inf)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (10, 0.8), (1, 0.3), (500, 0.999)])
def test_top_k_top_p_filter_matches_sort_based_oracle(top_k, top_p):
    logits_BV = np.asarray(jax.random.normal(jax.random.key(top_k), (4, 300)) * 2.0, np.float32)
    got = np.asarray(draws.filter_top_k_top_p(jnp.asarray(logits_BV), jnp.full((4,), top_k),
                                                 jnp.full((4,), top_p, jnp.float32)))
    for b in range(4):
        np.testing.assert_array_equal(got[b], reference_filter(logits_BV[b], top_k, top_p))


def test_top_k_one_samples_the_argmax(model):
    params = SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    sampled = run(model, [RowRequest(p, params, seed=s) for s, p in enumerate(PROMPTS)])
    greedy = run(model, [RowRequest(p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), seed=0)
                         for p in PROMPTS])
    np.testing.assert_array_equal(sampled.tokens_BT, greedy.tokens_BT)


def test_prompts_in_one_bucket_share_one_program(model):
    graphdef, state = nnx.split(model)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    before = compiled_programs()
    for prompt in [(1, 2), (3, 4, 5, 6, 7), tuple(range(1, 17))]:
        batch = make_batch([RowRequest(prompt, params, seed=0)], (), batch_size=4, prompt_len=16)
        generate(graphdef, state, batch, max_new_tokens=16)
    assert compiled_programs() - before <= 2  # one prefill and one decode phase (U + T - 1 = 31 slots)


def test_buckets_and_validation():
    assert [bucket(n) for n in (0, 1, 16, 17, 100)] == [16, 16, 16, 32, 128]
    assert [batch_bucket(n) for n in (1, 3, 32, 33)] == [1, 4, 32, 64]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-2)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-3,))
    with pytest.raises(ValueError, match="prompt_ids"):
        make_batch([RowRequest((), SamplingParams(), seed=0)], (), batch_size=1, prompt_len=16)
    with pytest.raises(ValueError, match="batch_size"):
        make_batch([RowRequest((1,), SamplingParams(), seed=0)] * 3, (), batch_size=2, prompt_len=16)
