"""Router replay and the router's own terms on a tiny Qwen3-MoE (float32): the sampler records the experts it chose,
the policy's forward replays them (its log-probs then equal the behaviour log-probs, even where near-tied router
logits would flip), forced routing equal to the router's own choice changes nothing, and the load-balancing loss is
transformers' and trains the router."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models import transformer
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.moe import load_balancing_loss, router_z_loss
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.step.batch import Batch
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.policy import policy_logprobs
from drgrpo_jax.step.train_step import init_state, train_step

from support.tiny_models import write_tiny_gpt_oss, write_tiny_qwen3_moe

PROMPTS = [(1, 7, 12, 30, 4), (1, 22), (1, 40, 41, 9, 9, 9, 3, 17, 25)]
PROMPT_LEN, NEW = 16, 12
TOL = 1e-5


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory):
    return write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("qwen3_moe")))


@pytest.fixture(scope="module")
def qwen3_moe(qwen3_moe_folder):
    return from_pretrained(qwen3_moe_folder)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return from_pretrained(write_tiny_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss"))))


def _ids(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).randint(3, 96, shape))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_forcing_the_routers_own_choice_changes_nothing(family, request):
    model = request.getfixturevalue(family)
    ids = _ids(0, (2, 9))
    segments = jnp.asarray(np.r_[[[0, 0] + [1] * 7], [[1] * 9]])  # a left-padded row
    positions = jnp.maximum(jnp.cumsum(segments, axis=1) - 1, 0)
    hidden = model.hidden_states(ids, positions, segments)
    # The router's own choice, read where the sampler reads it: the cached decode over the same tokens.
    _, _, chosen_BTLk = model.decode_routed(ids, jnp.where(segments > 0, positions, -1),
                                            init_cache(model.config, 2, 9))
    forced, stats = model.hidden_states_and_router(ids, positions, segments, routed_experts_BTLk=chosen_BTLk)
    np.testing.assert_array_equal(np.asarray(forced)[segments > 0], np.asarray(hidden)[segments > 0])
    assert stats.counts_Le.sum() == 16 * model.config.experts_per_token * model.config.num_layers  # real tokens only
    with pytest.raises(ValueError, match=r"routed_experts: shape \(2, 9, 1, 2\), expected"):
        model.hidden_states(ids, routed_experts_BTLk=chosen_BTLk[:, :, :1])


def test_a_dense_model_refuses_forced_routing():
    dense = Transformer(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                                      num_heads=2, num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="routed_experts: llama has no router"):
        dense.hidden_states(_ids(0, (1, 3)) % 32, routed_experts_BTLk=jnp.zeros((1, 3, 1, 2), jnp.int32))


def test_load_balancing_loss_is_transformers(qwen3_moe, monkeypatch):
    """The same router logits (read off our forward) into transformers' load_balancing_loss_func, unmasked and
    masked; and the z-loss as its definition."""
    ids = _ids(1, (2, 7))
    mask = np.ones((2, 7), bool)
    mask[1, :3] = False
    captured = []
    original = transformer.router_stats

    def capture(logits_Me, *rest):
        captured.append(logits_Me)
        return original(logits_Me, *rest)

    monkeypatch.setattr(transformer, "router_stats", capture)
    k, e = qwen3_moe.config.experts_per_token, qwen3_moe.config.num_experts
    for counted in (None, jnp.asarray(mask)):
        captured.clear()
        with jax.disable_jit():  # the layer scan runs layer by layer, each layer's logits concrete
            _, stats = qwen3_moe.hidden_states_and_router(ids, counted_BT=counted)
        logits = tuple(torch.tensor(np.asarray(x)) for x in captured)
        assert len(logits) == qwen3_moe.config.num_layers
        theirs = load_balancing_loss_func(logits, e, k, None if counted is None else torch.tensor(mask))
        np.testing.assert_allclose(float(load_balancing_loss(stats)), float(theirs), rtol=1e-6)
        kept = np.ones(14, bool) if counted is None else mask.reshape(-1)
        z = np.mean([np.asarray(torch.logsumexp(x, -1) ** 2)[kept] for x in logits])
        np.testing.assert_allclose(float(router_z_loss(stats)), z, rtol=1e-6)


# ---------------------------------------------------------------- replay through the sampler and the step


def _sample(model):
    """(Batch of the sampled completions with the recorded experts, the behaviour log-probs [N, T])."""
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True)
    rows = [RowRequest(p, params, seed=3, sample=s) for p in PROMPTS for s in range(2)]
    batch = make_batch(rows, model.config.eos_token_ids, batch_size=8, prompt_len=PROMPT_LEN)
    out = jax.tree.map(np.asarray, generate(*nnx.split(model), batch, max_new_tokens=NEW,
                                            record_experts=True))
    n = len(rows)
    index = batch.rows.prompt_index_B[:n]
    response_mask = np.arange(NEW)[None] < out.lengths_B[:n, None]
    routed = np.concatenate([out.prompt_experts_PULk[index], out.experts_BTLk[:n]], axis=1)
    step_batch = Batch(prompt_ids=batch.prompt_ids_PU[index], prompt_mask=batch.prompt_positions_PU[index] >= 0,
                       response_ids=out.tokens_BT[:n], response_mask=response_mask,
                       advantages=np.linspace(-1, 1, n).astype(np.float32),
                       old_logprobs=out.logprobs_BT[:n], behaviour_logprobs=out.logprobs_BT[:n],
                       row_valid=np.ones(n, bool), routed_experts=routed)
    return step_batch, out.logprobs_BT[:n]


def _policy(model, batch, **config):
    graphdef, params = nnx.split(model, nnx.Param)
    step_config = StepConfig(loss=LossConfig(budget=NEW), logprob_chunk=5, **config)
    return np.asarray(jax.jit(lambda p, b: policy_logprobs(graphdef, step_config, p, b))(params, batch))


def _near_tied(model, delta):
    """A copy of `model` whose every layer routes a token with h.r > 0 to expert 2 and then to expert 0 or 1,
    whose logits differ by delta * h.r: a near tie that the sign of delta decides."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(jnp.copy, state)
    router = state["blocks"]["router"][...]  # [L, D, e]
    r = router[:, :, :1]
    tied = jnp.zeros_like(router).at[:, :, 0:1].set(r * (1 + delta)).at[:, :, 1:2].set(r).at[:, :, 2:3].set(3 * r)
    state["blocks"]["router"][...] = tied
    return nnx.merge(graphdef, state)


@pytest.mark.heavy
def test_replayed_forward_equals_the_behaviour_logprobs(qwen3_moe):
    batch, behaviour = _sample(qwen3_moe)
    mask = batch.response_mask
    assert mask.sum() > 40
    for config in ({}, {"pack_rows": 4, "pack_length": 32}):
        replayed = _policy(qwen3_moe, batch, **config)
        np.testing.assert_allclose(replayed[mask], behaviour[mask], atol=TOL, rtol=0)
    assert batch.routed_experts.shape == (6, PROMPT_LEN + NEW, 2, 2)


@pytest.mark.heavy
def test_replay_matters_where_near_tied_router_logits_flip(qwen3_moe):
    """The sampler's router and the trainer's differ only where two experts nearly tie (the trainer's near tie
    falls the other way): without replay the trainer reads another expert and its log-probs move; with replay they
    stay the behaviour log-probs to 1e-5."""
    sampler_model = _near_tied(qwen3_moe, 1e-6)
    trainer_model = _near_tied(qwen3_moe, -1e-6)
    batch, behaviour = _sample(sampler_model)
    mask = batch.response_mask
    replayed = _policy(trainer_model, batch)
    free = _policy(trainer_model, dataclasses.replace(batch, routed_experts=None))
    np.testing.assert_allclose(replayed[mask], behaviour[mask], atol=TOL, rtol=0)
    assert np.abs(free - behaviour)[mask].max() > 1e-2  # the flipped experts show


@pytest.mark.heavy
def test_the_aux_loss_trains_the_router_and_the_step_reports_expert_loads(qwen3_moe, qwen3_moe_folder):
    """Zero advantages: the policy gradient is 0, so only the router's terms move the router; full remat (the
    gradient summed in place, models/grad_sums.py) gives the same step."""
    batch, _ = _sample(qwen3_moe)
    batch = dataclasses.replace(batch, advantages=np.zeros_like(batch.advantages))
    batch = jax.tree.map(jnp.asarray, batch)
    moved, routers = {}, {}
    for coef, remat in ((0.0, "none"), (0.1, "none"), (0.1, "full")):
        model = from_pretrained(qwen3_moe_folder, remat=remat)
        graphdef, state = init_state(model, optax.sgd(1.0), jax.random.key(0))
        config = StepConfig(loss=LossConfig(budget=NEW), logprob_chunk=5, micro_batches=2, router_aux_coef=coef,
                            router_z_coef=coef)
        step = functools.partial(train_step, graphdef, optax.sgd(1.0), optax.constant_schedule(1.0), config)
        new_state, metrics = jax.jit(step)(state, batch)
        routers[coef, remat] = np.asarray(new_state.params["blocks"]["router"][...])
        moved[coef] = float(np.abs(routers[coef, remat] - np.asarray(state.params["blocks"]["router"][...])).max())
        L, e = qwen3_moe.config.num_layers, qwen3_moe.config.num_experts
        for layer in range(L):
            assert 1 / e <= float(metrics.router.expert_max_share_L[layer]) <= 1
            assert 0 <= float(metrics.router.expert_entropy_L[layer]) <= np.log(e) + 1e-6
        assert float(metrics.router.aux_loss) >= 1.0 - 1e-6  # 1 is perfect balance
        assert float(metrics.router.z_loss) > 0
    assert moved[0.0] == 0.0
    assert moved[0.1] > 0.0
    np.testing.assert_allclose(routers[0.1, "full"], routers[0.1, "none"], rtol=1e-5, atol=1e-7)


def test_the_router_coefficients_are_checked():
    with pytest.raises(ValueError, match="router_aux_coef"):
        StepConfig(loss=LossConfig(budget=4), router_aux_coef=-1.0)
    with pytest.raises(ValueError, match="router_z_coef"):
        StepConfig(loss=LossConfig(budget=4), router_z_coef=True)
