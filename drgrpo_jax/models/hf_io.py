"""Hugging Face checkpoints: safetensors (single or sharded) in, straight onto a mesh, and out again.

Also the HF-layout reader and `build_model` that `gguf_io` reuses (imports point one way: gguf_io -> hf_io;
`pretrained.from_pretrained` picks between the two).
"""

from __future__ import annotations

import json
import os
import re
import struct as pystruct
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from drgrpo_jax.hosts import host_array
from drgrpo_jax.models import mxfp4
from drgrpo_jax.models.config import DecoderConfig, RuntimeOptions, from_hf_config, hf_num_layers, to_hf_config
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import ShardingRules, named_sharding

_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# Prefixes under which multimodal wrappers keep the text decoder (Gemma 3 4B+ checkpoints).
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
_DEFAULT_SHARD_BYTES = 5 * 1024**3


# ---------------------------------------------------------------- safetensors, read lazily


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """(tensor table, byte offset of the data section) of one safetensors file; ValueError naming the file when it
    is not one (empty, cut short, a header that is not a JSON object)."""
    with open(path, "rb") as f:
        length, prefix = os.fstat(f.fileno()).st_size, f.read(8)
        size = pystruct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 0 < size <= length - 8:
            raise ValueError(f"{path} is not a safetensors file ({length} bytes, no header)")
        try:
            header = json.loads(f.read(size))
        except (ValueError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + size


class TensorIndex(Protocol):
    """HF tensor name -> host array in HF layout (`SafetensorsIndex`, `gguf_io.GGUFIndex`); its names and each
    one's shape and dtype (safetensors' name: "F32", "BF16", ...) from the headers, before anything is read."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray: ...

    def names(self) -> Iterable[str]: ...

    def header(self, name: str) -> tuple[tuple[int, ...], str]: ...


class SafetensorsIndex:
    """Name -> memory-mapped numpy tensor over every *.safetensors file of a folder."""

    def __init__(self, folder: str):
        index_path = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"path: no *.safetensors files in {folder}")
        self._entries: dict[str, tuple[str, dict[str, Any], int]] = {}
        for name in files:
            path = os.path.join(folder, name)
            header, data_start = _read_header(path)
            for tensor, entry in header.items():
                self._entries[_normalise(tensor)] = (path, entry, data_start)
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> Iterable[str]:
        return self._entries.keys()

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) as the file's header states them."""
        _, entry, _ = self._entries[name]
        return tuple(entry["shape"]), entry["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor, read-only and memory-mapped (no copy until used)."""
        if name not in self._entries:
            raise KeyError(f"weights: tensor {name!r} is missing from the checkpoint")
        path, entry, data_start = self._entries[name]
        if entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"weights: tensor {name!r} has unsupported dtype {entry['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._maps[path][data_start + begin:data_start + end]
        return raw.view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file under its own name (copied out of the file; bfloat16 included)."""
    header, data_start = _read_header(path)
    with open(path, "rb") as f:
        data = f.read()
    out = {}
    for name, entry in header.items():
        if entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"weights: tensor {name!r} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(data, np.uint8, end - begin, data_start + begin)
        out[name] = raw.view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"]).copy()
    return out


def _normalise(name: str) -> str:
    """Strip multimodal wrapper prefixes so text-decoder tensors read as model.*; Mixtral's sparse MLP
    (`block_sparse_moe`, the Hub's name) reads as `mlp`, transformers' own name for it."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if not name.startswith(("model.", "lm_head.")):  # saved from the bare decoder (LlamaModel etc.)
        return "model." + name
    return name


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file (bfloat16 included, via ml_dtypes)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        nbytes = array.size * array.dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format asks for an 8-byte aligned data section
    with open(path, "wb") as f:
        f.write(pystruct.pack("<Q", len(blob)))
        f.write(blob)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


# ---------------------------------------------------------------- name and layout mapping

# our stacked name -> (HF per-layer suffix, HF -> ours, ours -> HF); c is the DecoderConfig.
_Transform = Callable[[np.ndarray, DecoderConfig], np.ndarray]
_LAYER_MAP: dict[str, tuple[str, _Transform, _Transform]] = {
    "attn_norm": ("input_layernorm.weight", lambda w, c: w, lambda w, c: w),
    "q_proj": ("self_attn.q_proj.weight",
               lambda w, c: w.reshape(c.num_heads, c.head_dim, c.hidden_size).transpose(2, 0, 1),
               lambda w, c: w.transpose(1, 2, 0).reshape(c.num_heads * c.head_dim, c.hidden_size)),
    "k_proj": ("self_attn.k_proj.weight",
               lambda w, c: w.reshape(c.num_kv_heads, c.head_dim, c.hidden_size).transpose(2, 0, 1),
               lambda w, c: w.transpose(1, 2, 0).reshape(c.num_kv_heads * c.head_dim, c.hidden_size)),
    "v_proj": ("self_attn.v_proj.weight",
               lambda w, c: w.reshape(c.num_kv_heads, c.head_dim, c.hidden_size).transpose(2, 0, 1),
               lambda w, c: w.transpose(1, 2, 0).reshape(c.num_kv_heads * c.head_dim, c.hidden_size)),
    "o_proj": ("self_attn.o_proj.weight",
               lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
               lambda w, c: w.reshape(c.num_heads * c.head_dim, c.hidden_size).T),
    "q_bias": ("self_attn.q_proj.bias", lambda w, c: w.reshape(c.num_heads, c.head_dim), lambda w, c: w.reshape(-1)),
    "k_bias": ("self_attn.k_proj.bias", lambda w, c: w.reshape(c.num_kv_heads, c.head_dim),
               lambda w, c: w.reshape(-1)),
    "v_bias": ("self_attn.v_proj.bias", lambda w, c: w.reshape(c.num_kv_heads, c.head_dim),
               lambda w, c: w.reshape(-1)),
    "o_bias": ("self_attn.o_proj.bias", lambda w, c: w, lambda w, c: w),
    "sinks": ("self_attn.sinks", lambda w, c: w, lambda w, c: w),
    "router_bias": ("mlp.router.bias", lambda w, c: w, lambda w, c: w),
    "expert_down_bias": ("mlp.experts.down_proj_bias", lambda w, c: w, lambda w, c: w),
    "q_norm": ("self_attn.q_norm.weight", lambda w, c: w, lambda w, c: w),
    "k_norm": ("self_attn.k_norm.weight", lambda w, c: w, lambda w, c: w),
    "gate_proj": ("mlp.gate_proj.weight", lambda w, c: w.T, lambda w, c: w.T),
    "up_proj": ("mlp.up_proj.weight", lambda w, c: w.T, lambda w, c: w.T),
    "down_proj": ("mlp.down_proj.weight", lambda w, c: w.T, lambda w, c: w.T),
}


# A sparse MLP's experts: ours [e, X, Y] stacks each expert's HF [Y, X] weight transposed (Mixtral names them
# w1, w3, w2 under `block_sparse_moe`).
_EXPERT_PROJ = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}
# A family whose mixture's HF names are its own: (the MLP's module, our expert parameter -> its per-expert module).
_MOE_NAMES = {"mixtral": ("block_sparse_moe", {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"})}


def _moe_names(config: DecoderConfig) -> tuple[str, dict[str, str]]:
    """This family's MLP module and per-expert module names as it saves them."""
    return _MOE_NAMES.get(config.family, ("mlp", _EXPERT_PROJ))


def _read_moe(index: TensorIndex, name: str, layer: int, config: DecoderConfig) -> np.ndarray:
    """A sparse MLP's `router` [D, e] or experts' weight [e, X, Y] of one layer, from HF's per-expert tensors
    (`mlp.experts.{j}.gate_proj.weight`, the Hub's layout and what transformers saves) or the fused ones
    (`mlp.experts.gate_up_proj` [e, 2f, D], gate rows first, and `mlp.experts.down_proj` [e, D, f])."""
    prefix = f"model.layers.{layer}.mlp."
    if name == "router":
        return index.get(prefix + "gate.weight").T
    fused = prefix + ("experts.down_proj" if name == "expert_down" else "experts.gate_up_proj")
    if fused in index:
        w, f = index.get(fused), config.moe_intermediate_size
        w = {"expert_gate": w[:, :f], "expert_up": w[:, f:]}.get(name, w)
        return w.transpose(0, 2, 1)
    return np.stack([index.get(f"{prefix}experts.{j}.{_moe_names(config)[1][name]}.weight").T
                     for j in range(config.num_experts)])


# GPT-OSS keeps each expert's gate and up interleaved in one tensor (gate columns even, up odd), ours apart.
_GPT_OSS_INTERLEAVED = {"expert_gate": ("gate_up_proj", 0), "expert_up": ("gate_up_proj", 1),
                        "expert_gate_bias": ("gate_up_proj_bias", 0), "expert_up_bias": ("gate_up_proj_bias", 1)}


def _read_gpt_oss_moe(index: TensorIndex, name: str, layer: int) -> np.ndarray:
    """GPT-OSS's `router` [D, e] or experts' weight of one layer: transformers keeps the experts as ours are
    ([e, X, Y]), gate and up interleaved in `experts.gate_up_proj` [e, D, 2f] and its bias [e, 2f]; the published
    checkpoints hold the two weights as MXFP4 blocks and scales (`models/mxfp4.py`)."""
    prefix = f"model.layers.{layer}.mlp."
    if name == "router":
        return index.get(prefix + "router.weight").T
    if name == "expert_down":
        return _gpt_oss_expert(index, prefix + "experts.down_proj")
    tensor, parity = _GPT_OSS_INTERLEAVED[name]
    return _gpt_oss_expert(index, f"{prefix}experts.{tensor}")[..., parity::2]


def _gpt_oss_expert(index: TensorIndex, name: str) -> np.ndarray:
    """An expert tensor as stored, or dequantized from its MXFP4 `_blocks` and `_scales`."""
    if name not in index and name + "_blocks" in index:
        return mxfp4.dequantize(index.get(name + "_blocks"), index.get(name + "_scales"))
    return index.get(name)


def _gpt_oss_interleaved(arrays: dict[str, np.ndarray], config: DecoderConfig) -> dict[str, np.ndarray]:
    """GPT-OSS's `experts.gate_up_proj` and its bias, every layer, from our stacked gate and up arrays."""
    out = {}
    for layer in range(config.num_layers):
        for tensor, suffix in (("gate_up_proj", ""), ("gate_up_proj_bias", "_bias")):
            gate, up = arrays[f"expert_gate{suffix}"][layer], arrays[f"expert_up{suffix}"][layer]
            out[f"model.layers.{layer}.mlp.experts.{tensor}"] = np.stack([gate, up], axis=-1).reshape(
                *gate.shape[:-1], -1)
    return out


def _hf_layer_tensors(name: str, w: np.ndarray, layer: int, config: DecoderConfig) -> dict[str, np.ndarray]:
    """One layer of our parameter `name` under its HF name(s) and layout (Qwen3-MoE's and Mixtral's experts one by
    one, as transformers saves them; GPT-OSS's gate and up are `_gpt_oss_interleaved`'s)."""
    prefix = f"model.layers.{layer}."
    if config.traits.gpt_oss_experts and name == "router":
        return {prefix + "mlp.router.weight": np.ascontiguousarray(w.T)}
    if config.traits.gpt_oss_experts and name == "expert_down":
        return {prefix + "mlp.experts.down_proj": np.ascontiguousarray(w)}
    mlp, experts = _moe_names(config)
    if name == "router":
        return {f"{prefix}{mlp}.gate.weight": np.ascontiguousarray(w.T)}
    if name in _EXPERT_PROJ:
        return {f"{prefix}{mlp}.experts.{j}.{experts[name]}.weight": np.ascontiguousarray(w[j].T)
                for j in range(config.num_experts)}
    return {prefix + _layer_suffix(name, config): np.ascontiguousarray(_to_hf(name, w, config))}


def _layer_suffix(name: str, config: DecoderConfig) -> str:
    """HF per-layer tensor suffix of our stacked parameter (norm names differ for Gemma)."""
    if name == "mlp_norm":
        return "pre_feedforward_layernorm.weight" if config.traits.sandwich_norms else "post_attention_layernorm.weight"
    if name == "post_attn_norm":
        return "post_attention_layernorm.weight"
    if name == "post_mlp_norm":
        return "post_feedforward_layernorm.weight"
    return _LAYER_MAP[name][0]


def _to_ours(name: str, w: np.ndarray, config: DecoderConfig) -> np.ndarray:
    """One HF layer tensor in our layout."""
    return _LAYER_MAP[name][1](w, config) if name in _LAYER_MAP else w


def _to_hf(name: str, w: np.ndarray, config: DecoderConfig) -> np.ndarray:
    """One layer of our parameter in HF layout."""
    return _LAYER_MAP[name][2](w, config) if name in _LAYER_MAP else w


def hf_param_reader(index: TensorIndex, config: DecoderConfig) -> Callable[[str], np.ndarray]:
    """Function: our parameter path -> host numpy array in our layout (layers stacked)."""

    def read(path: str) -> np.ndarray:
        if path == "embed":
            return index.get("model.embed_tokens.weight")
        if path == "final_norm":
            return index.get("model.norm.weight")
        if path == "lm_head":
            return index.get("lm_head.weight").T
        name = path.split("/", 1)[1]
        if config.traits.gpt_oss_experts and name in ("router", "expert_down", *_GPT_OSS_INTERLEAVED):
            return np.stack([_read_gpt_oss_moe(index, name, i) for i in range(config.num_layers)])
        if name == "router" or name in _EXPERT_PROJ:
            return np.stack([_read_moe(index, name, i, config) for i in range(config.num_layers)])
        suffix = _layer_suffix(name, config)
        return np.stack([_to_ours(name, index.get(f"model.layers.{i}.{suffix}"), config)
                         for i in range(config.num_layers)])

    return read


# ---------------------------------------------------------------- the weights checked against the config

# What the loaders read as weights: floats (cast to the model's dtype), and GPT-OSS's MXFP4 experts as uint8 blocks
# and scales (models/mxfp4.py). An int8 or float8 tensor read as a float would load quantized codes as weights.
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_MXFP4_PARTS = ("_blocks", "_scales")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_NAME = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_TOP_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def _check_count(field: str, expected: int, found: set[int], what: str, source: str) -> None:
    """ValueError unless `found` is exactly 0..expected-1 (without counting to `expected`: it may be huge)."""
    if len(found) != expected or (found and max(found) != expected - 1):
        held = f"{len(found)} {what}" + (f" (numbered {min(found)}-{max(found)})" if found else "")
        raise ValueError(f"{field}: {source} says {expected}, the weights hold {held}")


def check_layer_count(index: TensorIndex, num_layers: int, source: str = "config.json") -> None:
    """ValueError naming num_hidden_layers unless the weights hold layers 0..num_layers-1 (names alone); `source`:
    what the error says the count came from."""
    found = {int(m.group(1)) for m in map(_LAYER_NAME.match, index.names()) if m}
    _check_count("num_hidden_layers", num_layers, found, "layers", source)


def _mxfp4_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The `_blocks` and `_scales` that hold an expert weight [e, X, Y] as MXFP4 (32 values per block of X)."""
    e, x, y = shape
    return {name + "_blocks": (e, y, x // 32, 16), name + "_scales": (e, y, x // 32)}


def _gpt_oss_shapes(index: TensorIndex, name: str, shape: tuple[int, ...], prefix: str) -> dict[str, tuple[int, ...]]:
    """GPT-OSS's HF tensors for our `router`/`expert_down`/gate-and-up parameter of one layer (`_read_gpt_oss_moe`)."""
    mlp = prefix + "mlp."
    if name == "router":
        return {mlp + "router.weight": shape[::-1]}
    if name == "expert_down":
        tensor, stored = mlp + "experts.down_proj", shape
    else:  # gate and up interleaved in one tensor
        tensor, stored = f"{mlp}experts.{_GPT_OSS_INTERLEAVED[name][0]}", (*shape[:-1], 2 * shape[-1])
    if tensor not in index and tensor + "_blocks" in index:
        return _mxfp4_shapes(tensor, stored)
    return {tensor: stored}


def _layer_shapes(index: TensorIndex, name: str, shape: tuple[int, ...], layer: int,
                  config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensors (name -> shape) `hf_param_reader` reads for one layer of our parameter `name` [*shape]."""
    prefix = f"model.layers.{layer}."
    if config.traits.gpt_oss_experts and name in ("router", "expert_down", *_GPT_OSS_INTERLEAVED):
        return _gpt_oss_shapes(index, name, shape, prefix)
    if name == "router":
        return {prefix + "mlp.gate.weight": shape[::-1]}
    if name in _EXPERT_PROJ:
        fused = prefix + ("mlp.experts.down_proj" if name == "expert_down" else "mlp.experts.gate_up_proj")
        if fused in index:  # [e, 2f, D] gate rows first, or [e, D, f]
            e, x, y = shape
            return {fused: (e, y, x) if name == "expert_down" else (e, 2 * y, x)}
        per_expert = _moe_names(config)[1][name]
        return {f"{prefix}mlp.experts.{j}.{per_expert}.weight": shape[:0:-1] for j in range(config.num_experts)}
    # A zero-strided array of our shape: the layout's own transform gives the HF shape without allocating it.
    ours = np.broadcast_to(np.zeros((), np.uint8), shape)
    return {prefix + _layer_suffix(name, config): _to_hf(name, ours, config).shape}


def _expected_tensors(index: TensorIndex, config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the model's parameters are read from, with the shape `config` implies."""
    out: dict[str, tuple[int, ...]] = {}
    for path, (shape, _) in param_specs(config).items():
        if path in _TOP_TENSORS:
            out[_TOP_TENSORS[path]] = shape[::-1] if path == "lm_head" else shape
            continue
        for layer in range(config.num_layers):
            out.update(_layer_shapes(index, path.split("/", 1)[1], shape[1:], layer, config))
    return out


def check_weights(index: TensorIndex, config: DecoderConfig, source: str = "config.json") -> None:
    """ValueError in one line, before anything is read or allocated, when the weights are not what `config` (read
    from `source`) describes: their layers and experts counted, then every tensor's presence, shape and dtype
    (headers only)."""
    check_layer_count(index, config.num_layers, source)
    experts = {int(m.group(1)) for m in map(_EXPERT_NAME.match, index.names()) if m}
    if config.moe and experts:  # one tensor per expert: counted before they are listed one by one
        _check_count("num_experts/num_local_experts", config.num_experts, experts, "experts", source)
    for name, shape in _expected_tensors(index, config).items():
        if name not in index:
            raise ValueError(f"weights: tensor {name!r} is missing from the checkpoint")
        stored, dtype = index.header(name)
        if stored != shape:
            raise ValueError(f"weights: {name} has shape {list(stored)}, {source} implies {list(shape)}")
        allowed = ("U8",) if name.endswith(_MXFP4_PARTS) else _FLOAT_DTYPES
        if dtype not in allowed:
            raise ValueError(f"weights: {name} is {dtype}, not one of {list(allowed)}: only float weights load (and "
                             "GPT-OSS's MXFP4 experts); dequantize the checkpoint first")


# ---------------------------------------------------------------- building a model from host arrays


def build_model(config: DecoderConfig, read: Callable[[str], np.ndarray], *, dtype=jnp.float32,
                mesh: Mesh | None = None, rules: ShardingRules = ShardingRules(),
                runtime: RuntimeOptions | None = None) -> Transformer:
    """A Transformer whose parameters come from `read(path)`, each placed on its shards directly."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, runtime=runtime))
    graphdef, state = nnx.split(abstract)
    specs = param_specs(config)
    np_dtype = np.dtype(dtype)
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        shape, axes = specs[name]
        host = read(name)
        if tuple(host.shape) != shape:
            raise ValueError(f"weights: {name} has shape {tuple(host.shape)}, the config implies {shape}")
        if mesh is None:
            value = jnp.asarray(np.asarray(host, dtype=np_dtype))
        else:
            sharding = named_sharding(name, shape, axes, mesh, rules)
            # Each device receives only its own slice of the host array.
            def device_slice(index, host: np.ndarray = host) -> np.ndarray:
                return np.asarray(host[index], dtype=np_dtype)

            value = jax.make_array_from_callback(shape, sharding, device_slice)
        variable.set_value(value) if hasattr(variable, "set_value") else setattr(variable, "value", value)
    return nnx.merge(graphdef, state)


def _read_config_files(folder: str) -> tuple[Any, Any]:
    """A folder's parsed config.json and generation_config.json (None when absent)."""
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    generation = None
    generation_path = os.path.join(folder, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path) as f:
            generation = json.load(f)
    return hf, generation


def load_hf_config(folder: str) -> DecoderConfig:
    """DecoderConfig from a folder's config.json (+ generation_config.json for extra stop tokens)."""
    return from_hf_config(*_read_config_files(folder))


def load_hf(folder: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
            rules: ShardingRules = ShardingRules(), runtime: RuntimeOptions | None = None) -> Transformer:
    """A Transformer from an HF folder (config.json + safetensors); the config is checked against the weights'
    headers (`check_weights`) before any weight is read."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"path: {folder!r} is neither a folder with config.json nor a .gguf file")
    hf, generation = _read_config_files(folder)
    index = SafetensorsIndex(folder)
    check_layer_count(index, hf_num_layers(hf))  # first: a config's per-layer lists are as long as it says
    config = from_hf_config(hf, generation)
    check_weights(index, config)
    return build_model(config, hf_param_reader(index, config), dtype=dtype, mesh=mesh, rules=rules, runtime=runtime)


# ---------------------------------------------------------------- export


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """Every parameter under its HF name and layout."""
    config = model.config
    _, state = nnx.split(model)
    out: dict[str, np.ndarray] = {}
    interleaved: dict[str, np.ndarray] = {}
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        value = host_array(variable[...])
        if config.traits.gpt_oss_experts and name.split("/")[-1] in _GPT_OSS_INTERLEAVED:
            interleaved[name.split("/")[-1]] = value
        elif name == "embed":
            out["model.embed_tokens.weight"] = value
        elif name == "final_norm":
            out["model.norm.weight"] = value
        elif name == "lm_head":
            out["lm_head.weight"] = np.ascontiguousarray(value.T)
        else:
            layer_name = name.split("/", 1)[1]
            for i in range(config.num_layers):
                out.update(_hf_layer_tensors(layer_name, value[i], i, config))
    if interleaved:
        out.update(_gpt_oss_interleaved(interleaved, config))
    return out


def save_pretrained(model: Transformer, path: str, *, max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
                    tokenizer: Any = None) -> None:
    """Write an HF folder (config.json, generation_config.json, safetensors shards + index) transformers loads."""
    os.makedirs(path, exist_ok=True)
    tensors = hf_tensors(model)
    dtypes = {a.dtype for a in tensors.values()}
    torch_dtype = "bfloat16" if np.dtype(ml_dtypes.bfloat16) in dtypes else (
        "float16" if np.dtype(np.float16) in dtypes else "float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(model.config, torch_dtype), f, indent=2)
    generation = {"bos_token_id": model.config.bos_token_id, "eos_token_id": list(model.config.eos_token_ids)}
    if model.config.pad_token_id is not None:
        generation["pad_token_id"] = model.config.pad_token_id
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(path, file), shard)
            weight_map.update({name: file for name in shard})
        total = sum(a.nbytes for a in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
