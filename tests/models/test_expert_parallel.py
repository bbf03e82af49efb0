"""Expert parallelism (models/moe.py): under a mesh whose expert axis (fsdp) splits the experts, tokens travel to
their experts' shards by all-to-all; the numbers equal the one-device grouped path and a dense per-expert reference,
in value and gradient, with uneven expert loads and an idle expert."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.moe import clamped_swiglu, expert_shards, moe_mlp
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.sharding import (
    MeshShape,
    batch_sharding,
    make_mesh,
    param_shardings,
    place,
    traced_on_mesh,
)
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings

from support.tiny_models import write_tiny_gpt_oss
from support.tiny_step import STEP_RESPONSE, make_step_batch

GLU = clamped_swiglu(1.702, 7.0)
# Router biases that skew the loads: expert 0 takes most tokens, the last none.
SKEW = np.array([3.0, 2.0, 1.0, 0.5, 0.0, 0.0, -0.5, -1e4], np.float32)


def dense_reference(x_MD, p, k):
    """Every expert on every token (GPT-OSS routing: top-k logits, softmax over them; biased experts), masked by the
    routing weights: the oracle of the sparse MLP."""
    logits_Me = x_MD @ p["router"] + p["router_bias"][None]
    top_Mk, experts_Mk = jax.lax.top_k(logits_Me, k)
    share_Me = jnp.einsum("mk,mke->me", jax.nn.softmax(top_Mk, -1), jax.nn.one_hot(experts_Mk, logits_Me.shape[1]))
    gate_eMf = jnp.einsum("md,edf->emf", x_MD, p["expert_gate"]) + p["expert_gate_bias"][:, None]
    up_eMf = jnp.einsum("md,edf->emf", x_MD, p["expert_up"]) + p["expert_up_bias"][:, None]
    y_eMD = jnp.einsum("emf,efd->emd", GLU(gate_eMf, up_eMf), p["expert_down"]) + p["expert_down_bias"][:, None]
    return jnp.einsum("emd,me->md", y_eMD, share_Me)


def _layer(M=30, D=8, e=8, f=6, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    p = {"router": normal(D, e, scale=0.5), "router_bias": jnp.asarray(SKEW[:e]),
         "expert_gate": normal(e, D, f, scale=0.4), "expert_up": normal(e, D, f, scale=0.4),
         "expert_down": normal(e, f, D, scale=0.4), "expert_gate_bias": normal(e, f), "expert_up_bias": normal(e, f),
         "expert_down_bias": normal(e, D)}
    return normal(M, D), p


def _on_mesh(fn, mesh_shape):
    """fn jitted on a (data, fsdp, tensor) mesh of the first devices, traced under it, arguments replicated."""
    mesh = make_mesh(MeshShape(*mesh_shape), jax.devices()[:int(np.prod(mesh_shape))])
    replicated = NamedSharding(mesh, P())
    return jax.jit(traced_on_mesh(fn, mesh), in_shardings=replicated), mesh


def test_the_expert_path_is_chosen_by_the_traced_mesh():
    assert expert_shards(8) is None  # no mesh
    for mesh_shape, want in (((1, 1, 8), None), ((2, 4, 1), 4), ((1, 8, 1), 8), ((1, 4, 1), 4)):
        fn, mesh = _on_mesh(lambda x: x, mesh_shape)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            got = expert_shards(8)
        assert (None if got is None else got[1]) == want, mesh_shape
    fn, mesh = _on_mesh(lambda x: x, (1, 4, 1))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert expert_shards(6) is None  # 4 shards cannot hold 6 experts evenly: the grouped path


@pytest.mark.parametrize("mesh_shape", [(1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_expert_parallel_mlp_equals_the_dense_reference_in_value_and_gradient(mesh_shape):
    """30 tokens (not a multiple of every mesh's shards: padded), skewed loads and an idle expert, GPT-OSS's
    biases and clamped SwiGLU, the hidden dim split over the tensor axis; gradients through the router too."""
    x_MD, p = _layer()
    k = 2
    chosen_Mk = jax.lax.top_k(x_MD @ p["router"] + p["router_bias"][None], k)[1]
    loads = np.bincount(np.asarray(chosen_Mk).ravel(), minlength=8)
    assert loads[0] >= 25 and loads[-1] == 0, loads  # uneven, with an idle expert

    def loss(fn, x_MD, p):
        return jnp.sum(jnp.sin(fn(x_MD, p)))

    sparse = functools.partial(loss, lambda x, p: moe_mlp(x, p, k, False, GLU, topk_first=True)[0])
    ours, mesh = _on_mesh(jax.value_and_grad(sparse, argnums=(0, 1)), mesh_shape)
    got = ours(x_MD, p)
    oracle = jax.jit(jax.value_and_grad(functools.partial(loss, lambda x, p: dense_reference(x, p, k)),
                                        argnums=(0, 1)))(x_MD, p)
    np.testing.assert_allclose(got[0], oracle[0], rtol=1e-5)
    for (path, g), d in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(oracle[1])):
        np.testing.assert_allclose(g, d, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert np.all(np.asarray(got[1][1]["expert_gate"])[-1] == 0)  # the idle expert takes no gradient
    hlo = ours.lower(x_MD, p).as_text()
    assert "all_to_all" in hlo  # the expert-parallel path ran


# ---------------------------------------------------------------- the training step


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory):
    return write_tiny_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")), num_experts=8)


def _grad_optimizer() -> optax.GradientTransformation:
    """Keeps the window's gradient as its state and leaves the params: the step's gradient, read exactly."""
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _step_program(folder, fsdp):
    """(the jitted training step, its placed state and batch) of the skewed GPT-OSS on a (1, fsdp, 1) mesh."""
    mesh = make_mesh(MeshShape(data=1, fsdp=fsdp, tensor=1), jax.devices()[:fsdp])
    model = from_pretrained(folder, mesh=mesh)
    model.blocks.router_bias[...] = jnp.broadcast_to(jnp.asarray(SKEW), model.blocks.router_bias[...].shape)
    graphdef, state = init_state(model, _grad_optimizer(), jax.random.key(0))
    shardings = state_shardings(state, param_shardings(state.params, mesh), mesh)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), micro_batches=2, logprob_chunk=5)
    step = jit_train_step(graphdef, _grad_optimizer(), optax.constant_schedule(1.0), config, shardings, mesh)
    batch = make_step_batch()
    shift = np.random.default_rng(0).normal(scale=0.1, size=batch.old_logprobs.shape).astype(np.float32)
    batch = place(dataclasses.replace(batch, old_logprobs=shift - 4.0, behaviour_logprobs=shift - 4.0),
                  batch_sharding(mesh))
    return step, jax.device_put(state, shardings), batch


@pytest.mark.heavy
def test_training_step_loss_and_gradients_equal_on_1_2_4_8_expert_shards(gpt_oss_folder):
    results = {}
    for fsdp in (1, 2, 4, 8):
        step, state, batch = _step_program(gpt_oss_folder, fsdp)
        new_state, metrics = step(state, batch)
        results[fsdp] = jax.device_get((new_state.opt_state, metrics))
    grads, metrics = results[1]
    assert float(metrics.router.expert_max_share_L[0]) > 0.3  # uneven loads (1/8 balanced)
    assert np.abs(np.asarray(grads["blocks"]["expert_gate"])).max() > 0
    for fsdp in (2, 4, 8):
        got_grads, got_metrics = results[fsdp]
        np.testing.assert_allclose(got_metrics.loss, metrics.loss, rtol=1e-6, atol=1e-7)
        for (path, g), d in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(grads)):
            np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5 * max(np.abs(d).max(), 1e-6),
                                       err_msg=f"{jax.tree_util.keystr(path)} on fsdp={fsdp}")


@pytest.mark.heavy
def test_four_expert_shards_send_tokens_and_gather_neither_tokens_nor_experts(gpt_oss_folder):
    """The step on a 4-way expert mesh dispatches by all-to-all, and its compiled program all-gathers neither a
    layer's tokens across the expert axis (what XLA does with the experts sharded and no dispatch) nor whole
    experts. A micro-batch holds M = 8 rows x 17 positions = 136 tokens, 272 copies; D = 32, f = 16, e = 8."""
    step, state, batch = _step_program(gpt_oss_folder, 4)
    lowered = step.lower(state, batch)
    assert "all_to_all" in lowered.as_text()  # the dispatch is ours, not the partitioner's
    gathered = set(re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", lowered.compile().as_text()))
    assert gathered, "no all-gather at all: the pattern no longer reads the compiled program"
    tokens, experts = {"136,32", "272,32", "136,64"}, {"8,32,16", "8,16,32", "3,8,32,16", "3,8,16,32"}
    assert not gathered & (tokens | experts), sorted(gathered)
