"""LoRA: adapters on the stacked projections, the step and checkpoints with them, PEFT folders out and in, the
service serving a pushed adapter over HTTP, the trainer end to end, and the plan's counts."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.config.derived import lora_spec
from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.config import LoraSpec
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.lora import adapter_arrays, adapter_specs, add_adapters, load_adapter, merged_model, save_adapter
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer

from support.paths import REPO
from support.tiny_models import tiny_decoder_config
from support.tiny_step import lora_step_fn
from support.trainer_runs import kill_and_resume, start_trainer, trainer_overrides

TINY = tiny_decoder_config()
SPEC = LoraSpec(rank=4, alpha=8.0)


def _set(variable, value) -> None:
    variable.set_value(value) if hasattr(variable, "set_value") else setattr(variable, "value", value)


def with_adapters(model: Transformer, spec: LoraSpec = SPEC, b_scale: float = 0.1) -> Transformer:
    """`model` with adapters whose B is random (a fresh B = 0 would hide a wrong layout)."""
    model = add_adapters(model, spec, jax.random.key(1))
    for index, (name, variable) in enumerate(sorted(vars(model.blocks).items())):
        if name.endswith("_lora_b"):
            _set(variable, b_scale * jax.random.normal(jax.random.key(100 + index), variable[...].shape))
    return model


def adapters_of(model: Transformer) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in adapter_arrays(nnx.state(model, nnx.LoRAParam)).items()}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key, reason", [
    ("model.lora.rank=-1", "model.lora.rank", "must be >= 0"),
    ("model.lora.alpha=0", "model.lora.alpha", "must be finite and > 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout", r"must be in \[0, 1\)"),
    ("model.lora.targets=[q_proj,qkv_proj]", "model.lora.targets", "must be one or more distinct names"),
    ("model.lora.rnk=4", "model.lora.rnk", "unknown key.*did you mean model.lora.rank"),
])
def test_bad_lora_config_names_the_key(override, key, reason):
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: .*{reason}"):
        load_config(None, ["model.path=m", "model.lora.rank=8", override])
    assert lora_spec(load_config(None, ["model.path=m"])) is None  # rank 0: full fine-tuning
    spec = lora_spec(load_config(None, ["model.path=m", "model.lora.rank=8", "model.lora.targets=[v_proj,q_proj]"]))
    assert spec == LoraSpec(rank=8, alpha=32.0, targets=("v_proj", "q_proj")) and spec.scale == 4.0


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@nnx.jit
def _logits(model, ids):
    return model(ids)


@nnx.jit
def _hidden(model, ids, key):
    return model.hidden_states(ids, lora_key=key)


@pytest.mark.heavy
def test_adapters_add_x_a_b_in_every_path_and_merge_to_the_same_model():
    ids = jax.random.randint(jax.random.key(0), (2, 7), 0, TINY.vocab_size)
    base_logits = _logits(Transformer(TINY, rngs=nnx.Rngs(0)), ids)
    fresh = add_adapters(Transformer(TINY, rngs=nnx.Rngs(0)), SPEC, jax.random.key(1))
    np.testing.assert_array_equal(_logits(fresh, ids), base_logits)  # B = 0: a new adapter changes nothing
    model = with_adapters(Transformer(TINY, rngs=nnx.Rngs(0)))
    logits = _logits(model, ids)
    assert float(jnp.abs(logits - base_logits).max()) > 1e-2
    np.testing.assert_allclose(_logits(merged_model(model), ids), logits, atol=1e-5)  # x W + s x A B == x (W + s A B)
    # The cached decode path (what the sampler runs) adds the same term.
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    decoded, _ = nnx.jit(lambda m, x, p, c: m.decode(x, p, c))(model, ids, positions, init_cache(TINY, 2, 8))
    np.testing.assert_allclose(decoded, logits, atol=1e-5)
    # Dropout acts only when a key is given (training), and differs by key.
    dropped = with_adapters(Transformer(TINY, rngs=nnx.Rngs(0)), dataclasses.replace(SPEC, dropout=0.5))
    plain = nnx.jit(lambda m, x: m.hidden_states(x))
    np.testing.assert_allclose(plain(dropped, ids), plain(model, ids), atol=1e-6)
    one, two = _hidden(dropped, ids, jax.random.key(3)), _hidden(dropped, ids, jax.random.key(4))
    assert float(jnp.abs(one - two).max()) > 1e-3


def run_lora_step(mesh_shape, micro_batches, steps=1):
    """(initial state, state after each step, metrics of each) of LoRA steps (KL on) of the tiny model on a mesh."""
    model = add_adapters(Transformer(TINY, rngs=nnx.Rngs(0)), SPEC, jax.random.key(1))
    state, one, _ = lora_step_fn(model, mesh_shape, micro_batches)
    initial, states, history = jax.device_get(state), [], []
    for _ in range(steps):
        state, metrics = one(state)
        states.append(jax.device_get(state))
        history.append(jax.device_get(metrics))
    return initial, states, history


@pytest.mark.heavy
def test_step_trains_only_the_adapters_against_the_base_the_same_on_every_mesh_and_split():
    initial, states, history = run_lora_step((1, 1, 1), 1, steps=2)
    state = states[0]
    names = {str(path[-1]) for path, _ in nnx.to_flat_state(state.params)}
    assert names == {f"{t}_lora_{m}" for t in SPEC.targets for m in "ab"}  # gradients and Adam: adapters only
    moments = {leaf.shape for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim}
    assert moments == {leaf.shape for leaf in jax.tree.leaves(state.params)}
    for got, want in zip(jax.tree.leaves(states[-1].frozen), jax.tree.leaves(initial.frozen)):
        np.testing.assert_array_equal(got, want)  # the base never moves
    assert history[0].grad_norm > 0 and float(np.abs(state.params["blocks"]["q_proj_lora_b"][...]).max()) > 0
    # The KL reference is the base with the adapters off (no copy of the weights): 0 while B = 0, then it grows.
    assert state.ref_params is None and history[0].tokens.kl < 1e-9 < history[1].tokens.kl
    _, sharded, sharded_history = run_lora_step((2, 2, 2), 2)
    for got, want in zip(jax.tree.leaves(sharded[0].params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sharded_history[0].loss, history[0].loss, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# PEFT folders: transformers + peft load ours with equal logits; ours load back exactly
# ---------------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_peft_loads_our_adapter_with_equal_logits_and_the_merged_export_matches(tiny_model, tmp_path):
    import peft
    import torch
    import transformers

    from drgrpo_jax.models.hf_io import save_pretrained

    model = with_adapters(from_pretrained(tiny_model), LoraSpec(rank=4, alpha=12.0))
    arrays = adapters_of(model)
    save_adapter(arrays, model.runtime.lora, str(tmp_path / "adapter"), base_model=tiny_model)
    ids = np.random.default_rng(0).integers(3, 51, (2, 9))
    ours = np.asarray(model(jnp.asarray(ids)))

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = peft_model(torch.tensor(ids)).logits.numpy()
        with peft_model.disable_adapter():
            plain = peft_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    assert np.abs(plain - ours).max() > 1e-2  # the adapter matters: equal logits are not the base's

    spec, loaded = load_adapter(str(tmp_path / "adapter"), model.config)
    assert spec == LoraSpec(rank=4, alpha=12.0)
    for name, value in arrays.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)

    save_pretrained(merged_model(model), str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.tensor(ids)).logits.numpy(), ours, atol=1e-4)


def test_adapter_folders_we_cannot_apply_are_refused_by_name(tmp_path):
    arrays = {name: np.ones(shape, np.float32) for name, (shape, _) in adapter_specs(TINY, SPEC).items()}
    save_adapter(arrays, SPEC, str(tmp_path / "ok"))
    assert load_adapter(str(tmp_path / "ok"), TINY)[0] == SPEC
    wider = dataclasses.replace(TINY, hidden_size=48)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight has shape \(4, 32\), the model needs \(4, 48\)"):
        load_adapter(str(tmp_path / "ok"), wider)
    with open(tmp_path / "ok" / "adapter_config.json") as f:
        peft_config = json.load(f)
    for change, match in [({"use_dora": True}, "use_dora"), ({"target_modules": ["qkv"]}, "target_modules"),
                          ({"peft_type": "IA3"}, "peft_type")]:
        with open(tmp_path / "ok" / "adapter_config.json", "w") as f:
            json.dump(peft_config | change, f)
        with pytest.raises(ValueError, match=match):
            load_adapter(str(tmp_path / "ok"), TINY)


# ---------------------------------------------------------------------------------------------
# The service: a pushed adapter folder is merged and served (HTTP)
# ---------------------------------------------------------------------------------------------


@pytest.mark.subprocess  # the generation service as a child process
def test_service_serves_a_pushed_adapter_with_the_trainers_logprobs(tiny_model, tmp_path):
    from drgrpo_jax.rollout.client import RolloutClient
    from drgrpo_jax.rollout.local_service import LocalServer
    from drgrpo_jax.step.policy import response_logprobs

    model = with_adapters(from_pretrained(tiny_model), b_scale=0.5)
    save_adapter(adapters_of(model), model.runtime.lora, str(tmp_path / "weights" / "v1"), base_model=tiny_model)
    os.makedirs(tmp_path / "weights" / "bad")
    bad = adapters_of(model) | {"q_proj_lora_a": np.zeros((2, 32, 3), np.float32)}
    save_adapter(bad, model.runtime.lora, str(tmp_path / "weights" / "bad"))
    prompt = [5, 9, 14, 20]
    with LocalServer(tiny_model, weights_roots=[str(tmp_path / "weights")]) as server, \
            RolloutClient([server.url]) as client:
        before = client.generate([prompt], 1, max_new_tokens=8, temperature=0.0, seed=0)
        client.update_weights(str(tmp_path / "weights" / "v1"), 1)
        info = client.model_info()
        assert info["weight_version"] == "1" and info["adapter"]["rank"] == 4
        assert info["adapter"]["targets"] == list(SPEC.targets)
        after = client.generate([prompt], 1, max_new_tokens=8, temperature=0.0, seed=0, expected_version=1)
        refused = httpx.post(server.url + "/update_weights_from_disk", timeout=60,
                             json={"model_path": str(tmp_path / "weights" / "bad"), "weight_version": "2"})
        assert refused.status_code == 400 and "lora_A.weight has shape" in refused.json()["message"]
        assert client.model_info()["weight_version"] == "1"
    length = after.lengths[0]
    tokens, logprobs = after.response_ids[0][:length].tolist(), after.behaviour_logprobs[0][:length]
    assert after.weight_versions[0] == "1" and tokens != before.response_ids[0][:before.lengths[0]].tolist()
    graphdef, params = nnx.split(model)
    ids = np.asarray([tokens])
    ours, _ = response_logprobs(graphdef, params, np.asarray([prompt]), np.ones((1, 4), bool), ids,
                                np.ones_like(ids, bool), temperature=1.0, chunk=16)
    np.testing.assert_allclose(logprobs, np.asarray(ours)[0], atol=1e-4)  # merged on the service == x W + s x A B


# ---------------------------------------------------------------------------------------------
# The trainer end to end: adapter pushes, PEFT final/, merged export, checkpoints without the base; resume
# ---------------------------------------------------------------------------------------------

LORA_OVERRIDES = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.kl_coef=0.05", "model.lora.export_merged=true"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model, prompts_file):
    root = tmp_path_factory.mktemp("lora_train")
    output_dir = root / "uninterrupted"
    process = start_trainer(trainer_overrides(tiny_model, prompts_file, output_dir, steps=4) + LORA_OVERRIDES)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return {"root": root, "dir": output_dir, "model": tiny_model, "prompts": prompts_file}


def _train_rows(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


@pytest.mark.subprocess  # the trainer CLI and its generation service
def test_lora_run_pushes_adapters_and_exports_peft_and_merged_folders(lora_run):
    import transformers

    output_dir = lora_run["dir"]
    rows = _train_rows(output_dir)
    assert [r["weight_version"] for r in rows] == [0, 1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["kl"] > 0 and rows[-1]["grad_norm"] > 0  # the KL against the base (adapters off) grows
    for version in ("v3", "v4"):  # each push is a PEFT adapter folder naming the base, not the whole model
        assert sorted(os.listdir(output_dir / "weights" / version)) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    with open(output_dir / "weights" / "v4" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(lora_run["model"])
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(os.listdir(output_dir / "final"))
    spec, final = load_adapter(str(output_dir / "final"), from_pretrained(lora_run["model"]).config)
    assert spec.rank == 4 and float(np.abs(final["q_proj_lora_b"]).max()) > 0
    transformers.AutoModelForCausalLM.from_pretrained(output_dir / "final" / "merged")
    state_files = " ".join(open(os.path.join(root, name), errors="ignore").read()
                           for root, _, names in os.walk(output_dir / "checkpoints" / "4") for name in names
                           if name.endswith(("METADATA", ".json")))
    # Checkpoints hold the adapters and their optimizer state; the base (frozen: None there) is model.path's.
    assert "q_proj_lora_a" in state_files and "'embed'" not in state_files and "'q_proj'" not in state_files


@pytest.mark.subprocess
@pytest.mark.slow  # one more trainer run, killed after its step-2 checkpoint, then resumed (~2 minutes)
def test_lora_run_resumes_exactly_after_sigkill(lora_run):
    output_dir = lora_run["root"] / "killed"
    overrides = trainer_overrides(lora_run["model"], lora_run["prompts"], output_dir, steps=4) + LORA_OVERRIDES
    kill_and_resume(overrides, output_dir, checkpoint=2, timeout=600)
    timing = ("seconds", "per_second")
    for got, want in zip(_train_rows(output_dir), _train_rows(lora_run["dir"]), strict=True):
        assert {k: v for k, v in got.items() if not any(t in k for t in timing)} == {
            k: v for k, v in want.items() if not any(t in k for t in timing)}
    config = from_pretrained(lora_run["model"]).config
    got = load_adapter(str(output_dir / "final"), config)[1]
    want = load_adapter(str(lora_run["dir"] / "final"), config)[1]
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

LORA_CONFIGS = [("qwen2.5_math_7b_dr_grpo_lora_v5e8.yaml", "tpu-v5e"),
                ("qwen2.5_math_7b_dr_grpo_lora_1gpu.yaml", "h100")]


def test_plan_counts_base_adapters_and_optimizer_for_lora():
    from drgrpo_jax.models.config import from_hf_config
    from drgrpo_jax.plan import planner as plan
    from drgrpo_jax.plan.hardware import PRESETS

    model = from_hf_config(PRESETS["Qwen2.5-Math-7B"])
    full = plan.make_plan(load_config(None, ["model.path=x", "model.dtype=bfloat16", "mesh.fsdp=1"]), model)
    lora = plan.make_plan(load_config(None, ["model.path=x", "model.dtype=bfloat16", "mesh.fsdp=1",
                                             "model.lora.rank=16", "algorithm.kl_coef=0.01"]), model)
    D, I, Q, C, H, L, r = 3584, 18944, 28, 4, 128, 28, 16
    per_layer = r * ((D + Q * H) * 2 + (D + C * H) * 2 + (D + I) * 3)  # q, o; k, v; gate, up, down
    assert lora["model"]["adapter_parameters"] == L * per_layer
    assert lora["model"]["parameters"] == full["model"]["parameters"] == 7_615_616_512
    t = lora["trainer"]
    assert t["params"] == full["trainer"]["params"]  # the base, bfloat16, as in full fine-tuning
    assert t["adapters"] == L * per_layer * 4  # float32
    assert t["optimizer"] == 2 * t["adapters"] + 2 * 4  # Adam's two float32 moments (+ two int32 counts)
    assert t["gradients"] == 2 * t["adapters"] and t["reference"] == 0  # the reference is the base: no copy
    assert full["trainer"]["optimizer"] > 100 * t["optimizer"]
    targets = 2 * L * (D * Q * H + D * C * H) + 3 * L * D * I  # q, o; k, v; gate, up, down weights
    assert lora["service"]["adapter_merge"] == targets * 2


@pytest.mark.parametrize("name, device", LORA_CONFIGS)
def test_7b_lora_configs_fit_their_hardware_as_their_headers_say(name, device):
    from drgrpo_jax.plan import planner as plan
    from drgrpo_jax.plan.cli import _load
    from drgrpo_jax.plan.hardware import device_spec

    path = os.path.join(REPO, "configs", "recipes", name)
    header = open(path).read()
    config, _ = _load(path, [])
    tensor = int(found.group(1)) if (found := re.search(r"--serve-tensor (\d+)", header)) else 1
    result = plan.make_plan(config, plan.resolve_decoder_config(config, "Qwen2.5-Math-7B")[0],
                            device=device_spec(device), serve_tensor=tensor)
    assert config.model.lora.rank > 0 and all(result["fits"].values()), result["fits"]
    stated = re.search(r"-> trainer ([\d.]+) GiB", header)
    assert stated and float(stated.group(1)) == round(result["trainer"]["total"] / 2**30, 2)
