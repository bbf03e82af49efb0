"""The phased sampler (each prompt prefilled once, decode over a growing cache, finished rows dropped) against
the full-cache sampler it replaced, a full forward, and transformers' greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.models.logprobs import sequence_logprobs
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate, span_schedule
from drgrpo_jax.sampler.programs import compiled_programs

from support.full_cache_sampler import full_cache_sample
from support.tiny_models import tiny_sampler_model

SHORT, LONG = (5, 17, 3), (40, 2, 9, 11, 60, 7, 8)


@pytest.fixture(scope="module")
def model():
    return tiny_sampler_model()


def mixed_rows() -> list[RowRequest]:
    """4 samples of one prompt, 2 of another, 1 of a third: greedy, plain and filtered sampling, short and long
    budgets (3 rows outlive the first phase of 32 slots, 1 the second: the batch of 8 shrinks to 4, then 1 row)."""
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    plain = SamplingParams(max_new_tokens=6, temperature=1.0)
    filtered = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=5, top_p=0.9)
    return ([RowRequest(SHORT, greedy, seed=1, sample=0), RowRequest(SHORT, plain, seed=1, sample=1),
             RowRequest(SHORT, plain, seed=1, sample=2), RowRequest(SHORT, filtered, seed=1, sample=3)]
            + [RowRequest(LONG, plain, seed=2, sample=0),
               RowRequest(LONG, SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True), seed=2, sample=1)]
            + [RowRequest((1,), greedy, seed=3)])


@pytest.fixture(scope="module")
def mixed(model):
    """The mixed rows' batch and what the full-cache sampler draws for them."""
    batch = make_batch(mixed_rows(), model.config.eos_token_ids, batch_size=8, prompt_len=16)
    return batch, full_cache_sample(model, batch, 128)


@pytest.mark.heavy
@pytest.mark.parametrize("compact", [True, False])
def test_tokens_equal_the_full_cache_sampler_across_phases(model, mixed, compact):
    batch, oracle = mixed
    assert batch.prompt_ids_PU.shape == (4, 16)  # 3 distinct prompts (a bucket of 4) for 7 rows
    out = jax.tree.map(np.asarray, generate(*nnx.split(model), batch, max_new_tokens=128, compact=compact))
    np.testing.assert_array_equal(out.lengths_B, oracle["lengths"])
    np.testing.assert_array_equal(out.tokens_BT, oracle["tokens"])
    np.testing.assert_array_equal(out.stopped_B, oracle["stopped"])
    np.testing.assert_allclose(out.logprobs_BT, oracle["logprobs"], atol=1e-4)  # float32 rounding of big logits
    assert out.lengths_B[[0, 5, 6]].tolist() == [40, 60, 40]
    # Slots grow 32 -> 64 -> 143 (U + T - 1); rows finished by the end of a phase are dropped.
    assert [span for _, span, _ in out.phases] == [32, 64, 143]
    assert [rows for rows, _, _ in out.phases] == ([8, 4, 1] if compact else [8, 8, 8])
    assert sum(steps for _, _, steps in out.phases) == out.num_steps == 59
    # Row 5 decoded its last tokens alone in a batch of 1: its log-probs still equal a full forward's.
    ids = jnp.asarray([list(LONG) + out.tokens_BT[5, :60].tolist()], jnp.int32)
    trainer_BT, _ = jax.jit(sequence_logprobs)(model, ids[:, :-1], ids[:, 1:])  # one program, not one per operation
    np.testing.assert_allclose(out.logprobs_BT[5, :60], trainer_BT[0, len(LONG) - 1:], atol=1e-4)


@pytest.mark.heavy
def test_greedy_equals_transformers_greedy(tiny_model):
    """Our model and sampler on the tiny HF Llama against `generate(do_sample=False)` of transformers, prompt by
    prompt unpadded; a repeated prompt shares its prefill and must give the same continuation."""
    import torch
    import transformers

    from drgrpo_jax.models.pretrained import from_pretrained

    prompts = [(1, 7, 12, 30, 4), (1, 22), (1, 7, 12, 30, 4), (1, 40, 41, 9, 9, 9, 3, 17, 25)]
    ours = from_pretrained(tiny_model)
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    batch = make_batch([RowRequest(p, params, seed=0) for p in prompts], ours.config.eos_token_ids,
                       batch_size=4, prompt_len=16)
    out = jax.tree.map(np.asarray, generate(*nnx.split(ours), batch, max_new_tokens=64))
    reference = transformers.LlamaForCausalLM.from_pretrained(tiny_model).eval()
    for b, prompt in enumerate(prompts):
        with torch.inference_mode():
            full = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48, pad_token_id=0)
        expected = full[0, len(prompt):].tolist()
        assert out.tokens_BT[b, :out.lengths_B[b]].tolist() == expected
    assert max(out.lengths_B) > 16  # at least one row decoded past the first phase


def test_span_schedule_and_shared_prompt_rows():
    assert span_schedule(16, 16) == (31,)
    assert span_schedule(16, 64) == (32, 79)  # 64 skipped: 79 slots are less than 1.5 x 64
    assert span_schedule(16, 128) == (32, 64, 143)
    assert span_schedule(64, 1024) == (128, 256, 512, 1087)
    assert span_schedule(16, 1) == ()  # the prefill's token is the whole budget
    rows = [RowRequest(p, SamplingParams(), seed=0, sample=s) for s, p in enumerate([SHORT, LONG, SHORT, (1,)])]
    batch = make_batch(rows, (), batch_size=8, prompt_len=8)
    assert batch.prompt_ids_PU.shape == (4, 8) and batch.rows.prompt_index_B[:4].tolist() == [0, 1, 0, 2]
    assert batch.prompt_ids_PU[1, -len(LONG):].tolist() == list(LONG)
    assert batch.rows.prompt_lengths_B[:4].tolist() == [3, 7, 3, 1] and batch.rows.live_B.sum() == 4
    with pytest.raises(ValueError, match="num_prompts"):
        make_batch(rows, (), batch_size=8, prompt_len=8, num_prompts=2)


def _after(calls: int, mask: list[bool]):
    """An `unwanted` hook that wants every row for its first `calls` calls (phase boundaries), then not `mask`."""
    seen = []

    def unwanted() -> list[bool]:
        seen.append(1)
        return [False] * len(mask) if len(seen) <= calls else mask

    return unwanted


def _is_prefix(cut, full, rows) -> None:
    """Rows `rows` of `cut` hold the start of what `full` sampled for them, zeros after."""
    for b in rows:
        n = int(cut.lengths_B[b])
        assert n <= full.lengths_B[b]
        np.testing.assert_array_equal(cut.tokens_BT[b, :n], full.tokens_BT[b, :n])
        np.testing.assert_allclose(cut.logprobs_BT[b, :n], full.logprobs_BT[b, :n], atol=1e-4)
        assert not cut.tokens_BT[b, n:].any() and not cut.logprobs_BT[b, n:].any()


def _same_rows(cut, full, rows) -> None:
    np.testing.assert_array_equal(cut.lengths_B[rows], full.lengths_B[rows])
    np.testing.assert_array_equal(cut.stopped_B[rows], full.stopped_B[rows])
    np.testing.assert_array_equal(cut.tokens_BT[rows], full.tokens_BT[rows])
    np.testing.assert_allclose(cut.logprobs_BT[rows], full.logprobs_BT[rows], atol=1e-4)


@pytest.mark.heavy
def test_unwanted_rows_end_at_a_phase_boundary_and_change_no_other_row(model, mixed):
    """The `unwanted` hook (the service: rows whose clients left) is asked between phases: a batch nobody waits
    for ends at the next boundary with what it sampled; one row dropped leaves its batch-mates' tokens as they
    were; a batch still wanted is sampled as without the hook; no new program is compiled for any of it."""
    batch, _ = mixed
    graphdef, state = nnx.split(model)
    everyone = list(range(7))

    def run(unwanted=None, compact=True):
        return jax.tree.map(np.asarray, generate(graphdef, state, batch, max_new_tokens=128,
                                                 compact=compact, unwanted=unwanted))

    full, full_uncompacted = run(), run(compact=False)
    assert len(full.phases) == 3
    compiled = compiled_programs()

    wanted = run(unwanted=lambda: [False] * 7)
    _same_rows(wanted, full, everyone)
    assert wanted.phases == full.phases and wanted.num_steps == full.num_steps

    all_gone = run(unwanted=_after(1, [True] * 7))  # every client left during the first phase
    assert all_gone.phases == full.phases[:1]  # the second and third phases never ran
    first_steps = full.phases[0][2]
    assert all_gone.num_steps == first_steps
    np.testing.assert_array_equal(all_gone.lengths_B, np.minimum(full.lengths_B, 1 + first_steps))
    _is_prefix(all_gone, full, everyone)
    assert not all_gone.stopped_B[full.lengths_B > 1 + first_steps].any()
    assert (all_gone.lengths_B < full.lengths_B).sum() == 3  # rows 0, 5 and 6 were cut short

    gone_at_once = run(unwanted=lambda: [True] * 7)  # gone before decoding: the prefill's token only
    assert gone_at_once.phases == () and gone_at_once.lengths_B[:7].tolist() == [1] * 7

    row_5_gone = [b == 5 for b in everyone]  # the 60-token row's client left during the first phase
    kept_shapes = run(unwanted=_after(1, row_5_gone), compact=False)
    _same_rows(kept_shapes, full_uncompacted, [b for b in everyone if b != 5])
    _is_prefix(kept_shapes, full_uncompacted, [5])
    assert kept_shapes.lengths_B[5] == 1 + first_steps < full.lengths_B[5] and not kept_shapes.stopped_B[5]
    assert len(kept_shapes.phases) == 2  # rows 0 and 6 end within the second phase: the third is skipped
    assert compiled_programs() == compiled  # the hook is host-side: no program depends on it

    compacted = run(unwanted=_after(1, row_5_gone))  # compaction now keeps 2 rows, not 4: a smaller program
    _same_rows(compacted, full, [b for b in everyone if b != 5])
    _is_prefix(compacted, full, [5])
    assert [rows for rows, _, _ in compacted.phases] == [8, 2]



@pytest.mark.heavy
def test_check_every_pauses_a_phase_without_changing_a_token_or_compiling(model, mixed):
    """With `check_every`, the hook is also asked every few decode steps within a phase (the service's clients that
    leave during a long phase): a row dropped there ends at that pause, a batch nobody waits for ends at once, the
    rows still wanted come out as without pauses, and the pauses run the programs already compiled."""
    batch, _ = mixed
    graphdef, state = nnx.split(model)
    everyone = list(range(7))

    def run(unwanted=None, check_every=None):
        return jax.tree.map(np.asarray, generate(graphdef, state, batch, max_new_tokens=128,
                                                 unwanted=unwanted, check_every=check_every))

    full = run()
    compiled = compiled_programs()
    assert full.phases[0][2] > 8  # the first phase outlives two pauses of 4 steps

    paused = run(unwanted=lambda: [False] * 7, check_every=4)
    _same_rows(paused, full, everyone)
    assert paused.phases == full.phases and paused.num_steps == full.num_steps

    # Asked at the first phase's start, after 4 steps and after 8: gone from the third question on.
    all_gone = run(unwanted=_after(2, [True] * 7), check_every=4)
    assert all_gone.num_steps == 8 and len(all_gone.phases) == 1
    np.testing.assert_array_equal(all_gone.lengths_B, np.minimum(full.lengths_B, 1 + 8))
    _is_prefix(all_gone, full, everyone)

    row_5_gone = [b == 5 for b in everyone]
    one_gone = run(unwanted=_after(2, row_5_gone), check_every=4)
    _same_rows(one_gone, full, [b for b in everyone if b != 5])
    _is_prefix(one_gone, full, [5])
    assert one_gone.lengths_B[5] == 1 + 8 and not one_gone.stopped_B[5]
    assert compiled_programs() == compiled  # the step to pause at is traced: no program depends on it
    with pytest.raises(ValueError, match="check_every"):
        run(check_every=0)
