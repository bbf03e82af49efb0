"""The sharded service (`--mesh tensor=T[,data=D]`, issue #43), in process over HTTP (FastAPI's TestClient over a
real Scheduler): on 8 fake CPU devices a service with tensor=4, and one with tensor=2,data=2, return the same tokens
and log-probs as one device for the same seeds, before and after weight pushes from disk and shared memory and with
a LoRA adapter; every generation of weights lands split over the mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient

from drgrpo_jax import named_tensors as tensor_segment
from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.models.config import LoraSpec
from drgrpo_jax.models.hf_io import load_hf_config
from drgrpo_jax.models.lora import adapter_specs, save_adapter
from drgrpo_jax.rollout.weight_push import host_tensors
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch, mesh_rows
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sampler.programs import check_mesh
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.cli import parse_args
from drgrpo_jax.serve.scheduler import Scheduler
from drgrpo_jax.serve.weights import load_weights
from drgrpo_jax.sharding import MeshShape, make_mesh, parse_service_mesh, service_mesh

VOCAB = 64
MESHES = ("tensor=4", "tensor=2,data=2")
# Three prompts of different lengths, two samples each: 6 rows, padded to 8 (and 3 prompts to 4) on data=2.
PROMPTS = [[5, 9, 13, 7], [21, 3], [33, 8, 41, 17, 12, 6, 30]]


def write_model(path: str, seed: int) -> str:
    """A random 2-layer Llama with 4 query and 4 KV heads (so tensor=4 splits both), vocab 64, MLP 64."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, initializer_range=0.3)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The served model, a second version of it, and a LoRA adapter on attention and MLP (B nonzero)."""
    root = tmp_path_factory.mktemp("mesh")
    v0 = write_model(str(root / "v0"), seed=0)
    v1 = write_model(str(root / "v1"), seed=1)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    config = load_hf_config(v0)
    rng = np.random.default_rng(0)
    arrays = {name: rng.normal(0, 0.3, shape).astype(np.float32) for name, (shape, _) in adapter_specs(config,
                                                                                                       spec).items()}
    adapter = str(root / "adapter")
    save_adapter(arrays, spec, adapter, base_model=v0)
    return {"v0": v0, "v1": v1, "adapter": adapter}


def _client(scheduler: Scheduler) -> TestClient:
    return TestClient(build_app(scheduler, None), base_url="http://localhost", raise_server_exceptions=False)


def _generate(client: TestClient, seed: int) -> list[tuple[list[int], list[float]]]:
    """Sampled (temperature 1, top-p 0.9) and greedy rows, and a scored echo: each row's ids and log-probs."""
    rows = []
    for params in ({"temperature": 1.0, "top_p": 0.9, "n": 2}, {"temperature": 0.0}):
        answer = client.post("/generate", json={
            "input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": seed, **params}})
        assert answer.status_code == 200, answer.text
        for item in answer.json():
            rows.append((item["output_ids"], [lp for lp, _, _ in item["meta_info"]["output_token_logprobs"]]))
    # The OpenAI route's echo scores prompt and completion in one forward pass (serve/scoring.py) on the mesh too.
    answer = client.post("/v1/completions", json={"prompt": [PROMPTS[2]], "max_tokens": 3, "temperature": 0,
                                                  "logprobs": 1, "echo": True, "seed": seed})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    rows.append((choice["token_ids"], choice["logprobs"]["token_logprobs"][1:]))
    return rows


def _push_disk(client: TestClient, path: str, version: str) -> None:
    answer = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version})
    assert answer.status_code == 200, answer.text


def _push_segment(client: TestClient, path: str, version: str) -> None:
    loaded = load_weights(path, "float32", "x")  # the trainer's side: whole arrays on the host
    folder = tensor_segment.make_folder()
    name = tensor_segment.segment_name(folder, version)
    try:
        entries = tensor_segment.write_segment(name, host_tensors(loaded.graphdef, loaded.state))
        answer = client.post("/update_weights_from_tensor", json={
            "segment": name, "tensors": [e.to_json() for e in entries], "weight_version": int(version)})
    finally:
        tensor_segment.remove_folder(folder)
    assert answer.status_code == 200, answer.text


def _split_shards(scheduler: Scheduler) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each parameter's per-device shard shape and how many devices hold it."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(scheduler.weights.state):
        shards = leaf.addressable_shards
        out[jax.tree_util.keystr(path)] = (shards[0].data.shape, len({s.device for s in shards}))
    return out


def _run(folders, mesh: str) -> tuple[list, list]:
    """The outputs of one service through its life (start, disk push, segment push, adapter push), and where its
    q_proj, down_proj and lm_head shards lie after each step."""
    scheduler = Scheduler(ServeConfig(model=folders["v0"], mesh=mesh, max_batch_size=8, batch_wait_ms=1.0,
                                short_request_tokens=0))
    try:
        client = _client(scheduler)
        outputs, layouts = [], []

        def record(seed: int) -> None:  # after each push, the same requests
            outputs.append(_generate(client, seed))
            layouts.append(_split_shards(scheduler))

        record(7)
        _push_disk(client, folders["v1"], "1")
        record(7)
        _push_segment(client, folders["v0"], "2")
        record(7)
        _push_disk(client, folders["adapter"], "3")
        assert scheduler.weights.adapter is not None
        record(7)
        return outputs, layouts
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def one_device(folders):
    return _run(folders, "")


@pytest.mark.parametrize("mesh", MESHES)
def test_a_sharded_service_returns_one_devices_tokens_and_logprobs(folders, one_device, mesh):
    expected, _ = one_device
    # Same seed throughout: the segment push of v0 gives v0's rows back, v1 and the adapter change them.
    assert expected[2] == expected[0] and expected[1] != expected[0] and expected[3] != expected[0]
    got, layouts = _run(folders, mesh)
    assert len(got) == len(expected) == 4
    for stage, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert len(ours) == len(theirs) == 3 * 2 + 3 + 1
        for row, ((ids, lps), (ref_ids, ref_lps)) in enumerate(zip(ours, theirs, strict=True)):
            assert ids == ref_ids, (mesh, stage, row)
            np.testing.assert_allclose(lps, ref_lps, rtol=0, atol=1e-5, err_msg=f"{mesh} stage {stage} row {row}")
    tensor = parse_service_mesh(mesh).tensor
    devices = tensor * parse_service_mesh(mesh).data
    for layout in layouts:  # every generation of weights, the pushed ones too, split over heads, MLP and vocabulary
        q_shape, q_devices = layout["['blocks']['q_proj'].value"]
        assert q_shape == (2, 32, 4 // tensor, 8) and q_devices == devices
        assert layout["['blocks']['down_proj'].value"][0] == (2, 64 // tensor, 32)
        assert layout["['lm_head'].value"][0] == (32, VOCAB // tensor)


def test_the_mesh_parses_once_and_refuses_by_name(folders, capsys):
    assert parse_service_mesh("") == MeshShape(data=1, fsdp=1, tensor=1)
    assert parse_service_mesh("data=2, tensor=4") == MeshShape(data=2, fsdp=1, tensor=4)
    for bad, reason in (("tensor", "not tensor=N"), ("fsdp=2", "not tensor=N"), ("tensor=0", "positive int"),
                        ("tensor=2,tensor=2", "given twice"), ("tensor=x", "positive int")):
        with pytest.raises(ValueError, match=f"^--mesh: .*{reason}"):
            parse_service_mesh(bad)
    assert service_mesh(parse_service_mesh("tensor=1")) is None  # one device: the unsharded programs
    with pytest.raises(ValueError, match=r"--mesh: data x tensor = 2 x 8 = 16 devices, but this process has 8"):
        service_mesh(parse_service_mesh("tensor=8,data=2"))
    with pytest.raises(SystemExit):
        parse_args(["--model", folders["v0"], "--mesh", "tensor=16"])
    assert "--mesh: data x tensor = 1 x 16" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^mesh: "):
        ServeConfig(model=folders["v0"], mesh="heads=2")


def test_a_model_whose_heads_do_not_divide_is_refused_before_it_loads(folders):
    config = load_hf_config(folders["v0"])
    check_mesh(config, make_mesh(MeshShape(data=2, fsdp=1, tensor=4), jax.devices()))
    with pytest.raises(ValueError, match=r"^--mesh: blocks/q_proj: dimension 'q_heads' of size 4 .* \(size 8\)"):
        check_mesh(config, make_mesh(MeshShape(data=1, fsdp=1, tensor=8), jax.devices()))
    with pytest.raises(ValueError, match=r"--mesh: .*not divisible"):
        Scheduler(ServeConfig(model=folders["v0"], mesh="tensor=8"))


def test_rows_pad_to_a_multiple_of_the_data_ways():
    assert [mesh_rows(n) for n in (1, 3, 5, 8)] == [1, 4, 8, 8]  # one device: batch_bucket
    assert [mesh_rows(n, 2) for n in (1, 3, 5, 8)] == [2, 4, 8, 8]
    assert [mesh_rows(n, 3) for n in (1, 4, 7)] == [3, 6, 12]



# ---------------------------------------------------------------------------------------------
# The trainer's child service: rollout.service_mesh
# ---------------------------------------------------------------------------------------------

BASE = ["model.path=m", "data.path=d"]


def test_rollout_service_mesh_is_checked_by_name_before_anything_loads():
    from drgrpo_jax.config.load import load_config
    from drgrpo_jax.errors import ConfigError
    from drgrpo_jax.train.setup import check_service_mesh

    assert load_config(None, [*BASE, "rollout.service_mesh=tensor=2"]).rollout.service_mesh == "tensor=2"
    assert load_config(None, BASE).rollout.service_mesh == ""  # one device
    with pytest.raises(ConfigError, match=r"^rollout.service_mesh: 'heads=2' is not tensor=N or data=N"):
        load_config(None, [*BASE, "rollout.service_mesh=heads=2"])
    remote = load_config(None, [*BASE, "rollout.service_mesh=tensor=4,data=4", "rollout.urls=[http://127.0.0.1:1]"])
    check_service_mesh(remote)  # the services of rollout.urls run elsewhere: this host's devices do not count
    too_many = load_config(None, [*BASE, "rollout.service_mesh=tensor=4,data=4"])
    with pytest.raises(ConfigError, match=r"^rollout.service_mesh: data x tensor = 4 x 4 = 16 devices, but this "
                                          r"process has 8"):
        check_service_mesh(too_many)


@pytest.mark.subprocess
def test_the_trainers_child_service_on_a_mesh_matches_one_device(folders, one_device):
    """rollout.service_mesh reaches the child process as --mesh (LocalServer, as train/setup.py starts it)."""
    import httpx

    from drgrpo_jax.rollout.local_service import LocalServer

    expected, _ = one_device
    with LocalServer(folders["v0"], mesh="tensor=2,data=2", extra_args=["--max-batch-size", "8"]) as server:
        assert server.url is not None
        with httpx.Client(base_url=server.url, timeout=300) as http:
            got = _generate(http, 7)  # type: ignore[arg-type]  # httpx.Client speaks as the TestClient does
        assert "on 4 devices (data=2, tensor=2)" in server.log_tail()
    for (ids, lps), (ref_ids, ref_lps) in zip(got, expected[0], strict=True):
        assert ids == ref_ids
        np.testing.assert_allclose(lps, ref_lps, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Phases on the mesh: compaction between phases and rows cut by the service's cancel hook
# ---------------------------------------------------------------------------------------------


def test_phases_compaction_and_cut_rows_on_the_mesh_keep_each_rows_tokens(folders):
    """8 rows over several phases on tensor=2,data=2; the hook cuts 6 of them at the first phase boundary, so
    the 2 left are compacted to one row per data shard (`regrow` on the mesh): they keep one device's tokens."""
    rows = [RowRequest((5 + i, 9, 13), SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True), seed=3,
                       sample=i) for i in range(8)]
    kept = (2, 5)

    def run(mesh_spec: str, cut: bool):
        mesh = service_mesh(parse_service_mesh(mesh_spec))
        weights = load_weights(folders["v0"], "float32", "0", mesh)
        data = 1 if mesh is None else mesh.shape["data"]
        batch = make_batch(rows, (2,), batch_size=mesh_rows(8, data), prompt_len=16, num_prompts=mesh_rows(8, data))
        calls = []

        def unwanted() -> list[bool]:
            calls.append(1)
            return [cut and len(calls) > 1 and i not in kept for i in range(8)]

        return generate(weights.graphdef, weights.state, batch, max_new_tokens=64, unwanted=unwanted, mesh=mesh)

    full, cut = run("", cut=False), run("tensor=2,data=2", cut=True)
    assert len(cut.phases) >= 2 and cut.phases[-1][0] == 2  # the last phase ran the 2 kept rows only
    for b in kept:
        assert int(cut.lengths_B[b]) == int(full.lengths_B[b]) == 40
        np.testing.assert_array_equal(cut.tokens_BT[b], full.tokens_BT[b])
        np.testing.assert_allclose(cut.logprobs_BT[b], full.logprobs_BT[b], rtol=0, atol=1e-5)
    assert all(int(cut.lengths_B[b]) < 40 for b in range(8) if b not in kept)  # cut at the boundary
