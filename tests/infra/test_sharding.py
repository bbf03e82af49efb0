"""Mesh construction, logical-axis rules, and a sharded load that matches the unsharded model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.kv_cache import cache_shardings, init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import (
    MeshShape,
    ShardingRules,
    batch_sharding,
    logical_to_spec,
    make_mesh,
    named_sharding,
    shard_model,
)

pytestmark = pytest.mark.heavy  # models placed and compiled on several meshes

CONFIG = DecoderConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, folder) of a random tiny model saved in HF layout."""
    model = Transformer(CONFIG, rngs=nnx.Rngs(3))
    folder = tmp_path_factory.mktemp("tiny")
    save_pretrained(model, folder)
    return model, str(folder)


def test_mesh_shapes():
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(make_mesh(MeshShape(data=2, fsdp=-1, tensor=1)).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    with pytest.raises(ValueError, match="data\\*fsdp\\*tensor"):
        make_mesh(MeshShape(data=2, fsdp=2, tensor=1))
    with pytest.raises(ValueError, match="mesh.tensor"):
        MeshShape(tensor=0)
    with pytest.raises(ValueError, match="at most one"):
        MeshShape(data=-1, fsdp=-1)


def test_logical_rules():
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim")) == P(None, "fsdp", "tensor", None)
    assert logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
    with pytest.raises(ValueError, match="'mlp' and 'vocab' both map to mesh axis 'tensor'"):
        logical_to_spec(("mlp", "vocab"))
    with pytest.raises(ValueError, match="'embed' and 'vocab' both map to mesh axis 'fsdp'"):
        logical_to_spec(("embed", "vocab"), ShardingRules(vocab=("fsdp", "tensor")))
    with pytest.raises(ValueError, match="unknown logical axis"):
        logical_to_spec(("nope",))


def test_indivisible_dimension_is_an_error():
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match="blocks/k_proj: dimension 'kv_heads' of size 3"):
        named_sharding("blocks/k_proj", (2, 32, 3, 8), ("layers", "embed", "kv_heads", "head_dim"), mesh)


def test_sharded_load_matches_unsharded(saved):
    model, folder = saved
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    sharded = from_pretrained(folder, mesh=mesh)
    q = sharded.blocks.q_proj[...]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    # every device holds a quarter of q_proj (fsdp x tensor), replicated over data
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 2, 8)}
    assert sharded.embed[...].sharding.spec == P("tensor", "fsdp")

    ids = jax.device_put(jnp.asarray(np.random.RandomState(0).randint(0, 96, (4, 11))), batch_sharding(mesh))
    graphdef, state = nnx.split(sharded)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(jnp.asarray(np.asarray(ids)))), atol=1e-5)


def test_shard_model_and_sharded_decode(saved):
    model, _ = saved
    mesh = make_mesh(MeshShape(data=1, fsdp=4, tensor=2))
    sharded = shard_model(model, mesh)
    assert sharded.blocks.down_proj[...].sharding.spec == P(None, "tensor", "fsdp")
    graphdef, state = nnx.split(sharded)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 96, (4, 5)))
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (4, 5))
    cache = init_cache(CONFIG, 4, 8)
    cache_sharding = cache_shardings(cache, mesh)
    assert cache_sharding.k.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    cache = jax.device_put(cache, cache_sharding)
    logits, cache = jax.jit(lambda s, x, p, c: nnx.merge(graphdef, s).decode(x, p, c),
                            out_shardings=(None, cache_sharding))(state, ids, pos, cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(ids)), atol=1e-5)
    assert int(cache.length) == 5


def test_remat_policy_through_from_pretrained(saved):
    _, folder = saved
    model = from_pretrained(folder, remat="full")
    assert model.config == dataclasses.replace(CONFIG, remat="full")


def test_save_pretrained_from_a_sharded_model(saved, tmp_path):
    model, folder = saved
    sharded = from_pretrained(folder, mesh=make_mesh(MeshShape(data=2, fsdp=2, tensor=2)))
    save_pretrained(sharded, tmp_path)
    again = from_pretrained(str(tmp_path))
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 96, (2, 6)))
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
