"""Mesh construction, logical-axis rules, and a sharded load that matches the unsharded model."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from drgrpo_jax.models.config import DecoderConfig, RuntimeOptions
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.kv_cache import cache_shardings, init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import (
    MeshShape,
    ShardingRules,
    batch_sharding,
    device_grid,
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
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
    assert dict(make_mesh(MeshShape(data=2, fsdp=-1, tensor=1)).shape) == {"data": 2, "fsdp": 4, "context": 1,
                                                                          "tensor": 1}
    assert dict(make_mesh(MeshShape(data=1, fsdp=2, tensor=1, context=4)).shape) == {"data": 1, "fsdp": 2,
                                                                                   "context": 4, "tensor": 1}
    with pytest.raises(ValueError, match="data\\*fsdp\\*context\\*tensor"):
        make_mesh(MeshShape(data=2, fsdp=2, tensor=1))
    with pytest.raises(ValueError, match="mesh.context"):
        MeshShape(context=0)
    with pytest.raises(ValueError, match="mesh.tensor"):
        MeshShape(tensor=0)
    with pytest.raises(ValueError, match="at most one"):
        MeshShape(data=-1, fsdp=-1)


def test_one_slice_keeps_the_devices_order_on_cpu():
    """create_device_mesh lays TPU slices out by torus; on CPU its order is the devices' own, as before."""
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    assert list(mesh.devices.flat) == jax.devices()
    assert list(make_mesh(MeshShape(data=1, fsdp=3, tensor=1), jax.devices()[:3]).devices.flat) == jax.devices()[:3]


def _fake_devices(processes: int, per_process: int) -> list:
    """Stand-ins with what mesh_utils reads of CPU or GPU devices (all in slice 0: each process counts as one)."""
    return [SimpleNamespace(id=i, platform="cpu", device_kind="cpu", process_index=i // per_process, slice_index=0)
            for i in range(processes * per_process)]


def test_dcn_data_puts_the_outer_data_ways_across_slices():
    devices = _fake_devices(2, 4)
    grid = device_grid((4, 1, 1, 2), devices[::-1], dcn_data=2)  # any order in: grouped by slice
    assert grid.shape == (4, 1, 1, 2)
    assert {d.process_index for d in grid[:2].flat} == {0} and {d.process_index for d in grid[2:].flat} == {1}


def test_dcn_data_that_does_not_match_the_slices_is_an_error():
    with pytest.raises(ValueError, match=r"^mesh.dcn_data = 2, but the devices span 1 process\(es\)"):
        make_mesh(MeshShape(data=2, fsdp=2, tensor=2), dcn_data=2)  # one process: one slice
    with pytest.raises(ValueError, match=r"^mesh.dcn_data = 4, but the devices span 2 process\(es\)"):
        device_grid((4, 1, 2), _fake_devices(2, 4), dcn_data=4)
    with pytest.raises(ValueError, match=r"^mesh.dcn_data = 3 does not divide mesh.data = 4"):
        device_grid((4, 1, 2), _fake_devices(2, 4), dcn_data=3)


def test_logical_rules():
    # the state's model dim splits over fsdp x context (a context way holds a share, not a copy)
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim")) == P(None, ("fsdp", "context"), "tensor", None)
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
    assert q.sharding.spec == P(None, ("fsdp", "context"), "tensor", None)
    # every device holds a quarter of q_proj (fsdp x tensor), replicated over data
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 2, 8)}
    assert sharded.embed[...].sharding.spec == P("tensor", ("fsdp", "context"))

    ids = jax.device_put(jnp.asarray(np.random.RandomState(0).randint(0, 96, (4, 11))), batch_sharding(mesh))
    graphdef, state = nnx.split(sharded)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(jnp.asarray(np.asarray(ids)))), atol=1e-5)


def test_shard_model_and_sharded_decode(saved):
    model, _ = saved
    mesh = make_mesh(MeshShape(data=1, fsdp=4, tensor=2))
    sharded = shard_model(model, mesh)
    assert sharded.blocks.down_proj[...].sharding.spec == P(None, "tensor", ("fsdp", "context"))
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
    assert model.config == CONFIG and model.runtime == RuntimeOptions(remat="full")


def test_save_pretrained_from_a_sharded_model(saved, tmp_path):
    model, folder = saved
    sharded = from_pretrained(folder, mesh=make_mesh(MeshShape(data=2, fsdp=2, tensor=2)))
    save_pretrained(sharded, tmp_path)
    again = from_pretrained(str(tmp_path))
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 96, (2, 6)))
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
