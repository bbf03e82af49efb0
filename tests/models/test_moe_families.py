"""Every mixture-of-experts family against transformers: its config read and written back, logits (plain and
left-padded rows, both attention paths), HF folders in (per-expert and fused layouts) and out, expert-sharded
meshes, and greedy generation through the KV-cache sampler. What one family alone has stays in its own file
(test_moe.py, test_mixtral.py, test_gpt_oss.py)."""

import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from drgrpo_jax.models.config import from_hf_config, to_hf_config
from drgrpo_jax.models.families import FAMILIES
from drgrpo_jax.models.hf_io import read_safetensors, save_pretrained, write_safetensors
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh

from support.tiny_models import hf_logits, write_tiny_gpt_oss, write_tiny_mixtral, write_tiny_qwen3_moe

VOCAB = 96
TOL = 1e-4

# One tiny checkpoint per family and variant: (its writer, the config fields it must read as).
_EXPERTS_4 = dict(num_experts=4, experts_per_token=2, moe_intermediate_size=16)
MIXTURES = {
    "qwen3_moe-norm_topk": (functools.partial(write_tiny_qwen3_moe, norm_topk_prob=True),
                            dict(family="qwen3_moe", num_experts=8, experts_per_token=2, moe_intermediate_size=16,
                                 norm_topk_prob=True, sliding_window=None)),
    "qwen3_moe-raw_topk": (functools.partial(write_tiny_qwen3_moe, norm_topk_prob=False),
                           dict(family="qwen3_moe", num_experts=8, norm_topk_prob=False)),
    "mixtral-full": (write_tiny_mixtral, dict(family="mixtral", **_EXPERTS_4, norm_topk_prob=True,
                                              sliding_window=None, layer_types=())),
    "mixtral-sliding": (functools.partial(write_tiny_mixtral, sliding_window=4),
                        dict(family="mixtral", sliding_window=4, layer_types=("sliding_attention",) * 2)),
    "gpt_oss": (write_tiny_gpt_oss, dict(family="gpt_oss", **_EXPERTS_4, sliding_window=4, qkv_bias=True,
                                         o_bias=True, layer_types=("sliding_attention", "full_attention",
                                                                   "sliding_attention"))),
}
# The families whose checkpoints keep one tensor per expert: (their per-expert gate, up and down names).
PER_EXPERT = {"qwen3_moe-norm_topk": ("gate_proj", "up_proj", "down_proj"), "mixtral-sliding": ("w1", "w3", "w2")}


@pytest.fixture(scope="module")
def mixture(request, tmp_path_factory):
    """(transformers' model of one MIXTURES entry, the folder it was saved to, the entry's name)."""
    write, _ = MIXTURES[request.param]
    folder = write(str(tmp_path_factory.mktemp(request.param)))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return model, folder, request.param


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


def test_every_mixture_family_has_a_checkpoint_here():
    assert {fields["family"] for _, fields in MIXTURES.values()} == {
        name for name, family in FAMILIES.items() if family.sparse}


@pytest.mark.parametrize("mixture", MIXTURES, indirect=True)
def test_config_reads_the_experts_and_writes_them_back(mixture):
    model, _, name = mixture
    config = from_hf_config(model.config.to_dict())
    expected = MIXTURES[name][1]
    assert {field: getattr(config, field) for field in expected} == expected
    assert from_hf_config(type(model.config)(**to_hf_config(config)).to_dict()) == config


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("mixture", MIXTURES, indirect=True)
def test_logits_match_transformers(mixture, impl):
    """Rows longer than GPT-OSS's and Mixtral's window (4) and the YaRN context (16); left-padded rows too, whose
    padding is routed (dropless) and must change no real token's experts, window or sinks."""
    model, folder, _ = mixture
    ours = from_pretrained(folder, attention_impl=impl)
    ids = _ids(0, (2, 30))
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), hf_logits(model, ids), atol=TOL, rtol=0)
    lengths = np.array([24, 13, 5])
    real = np.arange(24)[None, :] >= (24 - lengths)[:, None]
    ids = np.where(real, _ids(1, (3, 24)), 0)
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    ref = hf_logits(model, ids, attention_mask=real.astype(np.int64), position_ids=positions)
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(positions, jnp.int32), jnp.asarray(real, jnp.int32)))
    np.testing.assert_allclose(got[real], ref[real], atol=TOL, rtol=0)


def _fuse_experts(src: str, dst: str, gate: str, up: str, down: str) -> None:
    """`src`'s folder rewritten in transformers' fused layout under `mlp` (Mixtral's Hub name is
    `block_sparse_moe`): experts.gate_up_proj [e, 2f, D], gate rows first, and experts.down_proj [e, D, f]."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    out = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items()
           if not re.search(r"\.experts\.\d+\.", k)}
    for prefix in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        num_experts = len({k for k in tensors if k.startswith(f"{prefix}.experts.") and k.endswith(f".{down}.weight")})

        def w(j, proj, prefix=prefix):
            return tensors[f"{prefix}.experts.{j}.{proj}.weight"]

        fused = prefix.replace(".block_sparse_moe", ".mlp")
        out[f"{fused}.experts.gate_up_proj"] = np.stack(
            [np.concatenate([w(j, gate), w(j, up)]) for j in range(num_experts)])
        out[f"{fused}.experts.down_proj"] = np.stack([w(j, down) for j in range(num_experts)])
    write_safetensors(os.path.join(dst, "model.safetensors"), out)


@pytest.mark.parametrize("mixture", PER_EXPERT, indirect=True)
def test_fused_layout_reads_the_same_model(mixture, tmp_path):
    model, folder, name = mixture
    fused = str(tmp_path / "fused")
    _fuse_experts(folder, fused, *PER_EXPERT[name])
    ids = _ids(2, (2, 9))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(fused, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(model, ids))  # transformers' own layout
    np.testing.assert_allclose(np.asarray(from_pretrained(fused)(jnp.asarray(ids))), hf_logits(model, ids),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("mixture", MIXTURES, indirect=True)
def test_saved_folder_loads_in_transformers_with_the_same_logits(mixture, tmp_path):
    model, folder, _ = mixture
    save_pretrained(from_pretrained(folder), str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == [type(model).__name__]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = _ids(3, (2, 21))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(model, ids), atol=1e-6, rtol=0)


@pytest.mark.heavy
@pytest.mark.parametrize("mixture, mesh_shape", [
    ("qwen3_moe-norm_topk", (1, 8, 1)), ("qwen3_moe-raw_topk", (2, 2, 2)), ("mixtral-sliding", (1, 4, 2)),
    ("gpt_oss", (2, 2, 2))], indirect=["mixture"])
def test_expert_sharded_logits_equal_transformers(mixture, mesh_shape):
    """Each fsdp shard holds e / fsdp whole experts (and their biases: GPT-OSS); sinks split over tensor."""
    model, folder, _ = mixture
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor))
    sharded = from_pretrained(folder, mesh=mesh)
    experts = sharded.config.num_experts
    assert sharded.blocks.expert_gate[...].sharding.spec == P(None, "fsdp", None, "tensor")
    for name in ("expert_gate", "expert_gate_bias"):
        if hasattr(sharded.blocks, name):
            assert {s.data.shape[1] for s in getattr(sharded.blocks, name)[...].addressable_shards} == {
                experts // fsdp}
    ids = jax.device_put(jnp.asarray(_ids(4, (8, 20))), batch_sharding(mesh))
    graphdef, state = nnx.split(sharded)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model, np.asarray(ids)), atol=TOL, rtol=0)


@pytest.mark.heavy
@pytest.mark.parametrize("mixture", ["qwen3_moe-raw_topk", "mixtral-sliding", "gpt_oss"], indirect=True)
def test_greedy_generation_equals_transformers_greedy(mixture):
    """The KV-cache sampler (left-padded rows; the sparse layers at decode, the windows and sinks in attend_slots)
    against transformers' generate, past the window and the YaRN context."""
    model, folder, _ = mixture
    ours = from_pretrained(folder)
    prompts = [(1, 7, 12, 30, 4), (1, 22), (1, 40, 41, 9, 9, 9, 3, 17, 25)]
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    batch = make_batch([RowRequest(p, params, seed=0) for p in prompts], ours.config.eos_token_ids,
                       batch_size=4, prompt_len=16)
    out = jax.tree.map(np.asarray, generate(*nnx.split(ours), batch, max_new_tokens=14))
    for b, prompt in enumerate(prompts):
        with torch.inference_mode():  # no EOS: a token like any other, as ignore_eos makes it for ours
            full = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=14, eos_token_id=None,
                                  pad_token_id=0)
        assert out.tokens_BT[b, :out.lengths_B[b]].tolist() == full[0, len(prompt):].tolist()
