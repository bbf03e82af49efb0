"""`generate(record_experts=True)`: a mixture's routed experts of every token the model read, recorded beside the
same tokens and log-probs, through chunked prefills and compacting phases alike; a dense model refuses it."""

import jax
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sampler import generate as driver  # the module: its PREFILL_CHUNK is what generate reads
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate

from support.tiny_models import write_tiny_qwen3_moe

PROMPTS = [(1, 7, 12, 30, 4), (1, 22), (1, 40, 41, 9, 9, 9, 3, 17, 25)]


def _generate(model, prompts, new, **kwargs):
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    rows = [RowRequest(p, params, seed=5, sample=s) for p in prompts for s in range(2)]
    batch = make_batch(rows, model.config.eos_token_ids, batch_size=8, prompt_len=16)
    return batch, jax.tree.map(np.asarray, generate(*nnx.split(model), batch, max_new_tokens=new, **kwargs))


@pytest.mark.heavy
def test_recording_keeps_the_tokens_and_records_what_the_router_chose(tmp_path, monkeypatch):
    model = from_pretrained(write_tiny_qwen3_moe(str(tmp_path)))
    L, k = model.config.num_layers, model.config.experts_per_token
    _, plain = _generate(model, PROMPTS, 20)
    batch, out = _generate(model, PROMPTS, 20, record_experts=True)
    for field in ("tokens_BT", "logprobs_BT", "lengths_B"):
        np.testing.assert_array_equal(getattr(out, field), getattr(plain, field))
    assert out.experts_BTLk.shape == (8, 20, L, k) and out.prompt_experts_PULk.shape == (4, 16, L, k)
    assert not out.prompt_experts_PULk[batch.prompt_positions_PU < 0].any()  # padding columns read nothing
    for b in range(6):
        prompt, n = PROMPTS[b // 2], int(out.lengths_B[b])
        read = np.asarray(prompt + tuple(out.tokens_BT[b, :n - 1]))[None]
        _, _, chosen = model.decode_routed(read, np.arange(read.shape[1])[None], init_cache(model.config, 1, 64))
        recorded = np.concatenate([out.prompt_experts_PULk[batch.rows.prompt_index_B[b], -len(prompt):],
                                   out.experts_BTLk[b, :n - 1]])
        np.testing.assert_array_equal(np.sort(recorded, -1), np.sort(np.asarray(chosen)[0], -1))
        assert not out.experts_BTLk[b, n - 1:].any()  # the last token is never read, nor what lies past it
    # A prompt prefilled in chunks records the same experts.
    monkeypatch.setattr(driver, "PREFILL_CHUNK", 4)
    _, chunked = _generate(model, PROMPTS, 20, record_experts=True)
    np.testing.assert_array_equal(chunked.prompt_experts_PULk, out.prompt_experts_PULk)
    np.testing.assert_array_equal(chunked.experts_BTLk, out.experts_BTLk)


def test_a_dense_model_refuses_to_record_experts():
    dense = Transformer(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                      num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="record_experts: llama has no router"):
        _generate(dense, [(1, 2)], 4, record_experts=True)
