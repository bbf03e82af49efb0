"""Weight pushes through shared memory (rollout.weight_sync): the segment format, the service's
/update_weights_from_tensor (bit-identical to a disk push), the pusher's clean-up and the mode choice."""

from __future__ import annotations

import os

import numpy as np
import pytest

from drgrpo_jax import named_tensors as tensor_segment
from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError, RolloutError, UnsafeSegment
from drgrpo_jax.rollout.weight_push import SegmentPusher, host_tensors, sync_mode

pytestmark = pytest.mark.skipif(not tensor_segment.available(), reason="needs a writable /dev/shm")


def _ours() -> list[str]:
    """This process's segment folders in /dev/shm, and the segments in them."""
    prefix, root = f"drgrpo_weights_{os.getpid()}_", tensor_segment.SEGMENT_DIR
    folders = [n for n in os.listdir(root) if n.startswith(prefix)]
    return sorted([*folders, *(f"{f}/{n}" for f in folders for n in os.listdir(os.path.join(root, f)))])


def _segments() -> list[str]:
    return [name for name in _ours() if "/" in name]


@pytest.fixture
def folder():
    """A private segment folder, removed with whatever is left in it."""
    made = tensor_segment.make_folder()
    yield made
    tensor_segment.remove_folder(made)


# ---------------------------------------------------------------------------------------------
# The segment format
# ---------------------------------------------------------------------------------------------


def test_a_segment_reads_back_every_tensor_bit_for_bit(folder):
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {"embed": rng.normal(size=(5, 3)).astype(np.float32),
               "layers/q_proj": rng.normal(size=(2, 3, 4)).astype(ml_dtypes.bfloat16),
               "final_norm": np.arange(3, dtype=np.float16), "empty": np.zeros((0, 4), np.float32)}
    name = tensor_segment.segment_name(folder, "7.0")
    try:
        entries = tensor_segment.write_segment(name, tensors)
        assert all(e.offset % 64 == 0 for e in entries)
        index = tensor_segment.parse_index([e.to_json() for e in entries])  # as it travels over HTTP
        back = tensor_segment.read_segment(name, index)
        assert back.keys() == tensors.keys()
        for key, array in tensors.items():
            assert back[key].dtype == array.dtype and back[key].shape == array.shape
            np.testing.assert_array_equal(back[key].view(np.uint8), array.view(np.uint8))
        too_long = [dict(entries[0].to_json(), shape=[500, 3])]
        with pytest.raises(ValueError, match="past the segment"):
            tensor_segment.read_segment(name, tensor_segment.parse_index(too_long))
    finally:
        tensor_segment.remove_segment(name)
    assert _segments() == []


@pytest.mark.parametrize("bad", ["../etc/passwd", "drgrpo_weights_1_a/b", "other_1_2", "drgrpo_weights_x_1", "",
                                 "drgrpo_weights_1_1\n", "drgrpo_weights_1_1.0",  # the old, predictable form
                                 "drgrpo_weights_1_abcdefgh/v1_0123456789abcdef\n",
                                 "drgrpo_weights_1_abcdefgh/../v1_0123456789abcdef",
                                 "/dev/shm/drgrpo_weights_1_abcdefgh/v1_0123456789abcdef"])
def test_segment_names_cannot_leave_the_shared_memory_folder(bad):
    with pytest.raises(ValueError, match="segment"):
        tensor_segment.read_segment(bad, [])


def test_bad_index_entries_are_named():
    with pytest.raises(ValueError, match=r"tensors\[1\]\.dtype"):
        tensor_segment.parse_index([{"name": "a", "dtype": "float32", "shape": [1], "offset": 0},
                                    {"name": "b", "dtype": "int64", "shape": [1], "offset": 64}])
    with pytest.raises(ValueError, match=r"tensors\[0\]: needs"):
        tensor_segment.parse_index([{"name": "a", "dtype": "float32", "offset": 0}])


def test_orphaned_segments_of_dead_writers_are_removed_and_live_ones_kept(folder):
    import tempfile

    dead_pid = 2**22 + 4321  # above Linux's largest pid: no such process
    dead_folder = os.path.basename(tempfile.mkdtemp(prefix=f"drgrpo_weights_{dead_pid}_",
                                                    dir=tensor_segment.SEGMENT_DIR))
    dead, mine = tensor_segment.segment_name(dead_folder, 3), tensor_segment.segment_name(folder, "3.9")
    try:
        for name in (dead, mine):
            tensor_segment.write_segment(name, {"x": np.ones(2, np.float32)})
        assert dead_folder in tensor_segment.remove_orphans()
        assert not os.path.exists(os.path.join(tensor_segment.SEGMENT_DIR, dead_folder))
        assert os.path.exists(os.path.join(tensor_segment.SEGMENT_DIR, mine))
    finally:
        tensor_segment.remove_folder(dead_folder)


# ---------------------------------------------------------------------------------------------
# Hostile shared memory (issue #57): any local process may create files in /dev/shm first
# ---------------------------------------------------------------------------------------------


def _victim(tmp_path) -> str:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    return str(victim)


def test_names_are_unpredictable_and_a_taken_one_is_never_written_through(folder, tmp_path):
    victim, root = _victim(tmp_path), tensor_segment.SEGMENT_DIR
    assert oct(os.stat(os.path.join(root, folder)).st_mode & 0o777) == "0o700"
    assert tensor_segment.segment_name(folder, 1) != tensor_segment.segment_name(folder, 1)
    link, planted = tensor_segment.segment_name(folder, 1), tensor_segment.segment_name(folder, 2)
    os.symlink(victim, os.path.join(root, link))  # as if the name had been guessed (root may write here)
    os.mkdir(os.path.join(root, planted))
    for name in (link, planted):
        with pytest.raises(UnsafeSegment, match="the name is taken"):
            tensor_segment.write_segment(name, {"x": np.ones(4, np.float32)})
    assert open(victim, "rb").read() == b"precious"
    assert os.path.islink(os.path.join(root, link)) and os.path.isdir(os.path.join(root, planted))  # left as found


def test_links_and_folders_planted_at_the_old_predictable_names_are_not_written_through(tiny_state, tmp_path):
    """Before: the pusher wrote /dev/shm/drgrpo_weights_<pid>_<version>.<n> through whatever was there."""
    graphdef, params = tiny_state
    victim, root = _victim(tmp_path), tensor_segment.SEGMENT_DIR
    link, planted = (os.path.join(root, f"drgrpo_weights_{os.getpid()}_{name}") for name in ("1.0", "2.1"))
    os.symlink(victim, link)
    os.mkdir(planted)
    try:
        with SegmentPusher(graphdef) as pusher:
            for version in (1, 2):
                assert pusher.push(_Client(), params, version).startswith("shm:drgrpo_weights_")
                assert open(victim, "rb").read() == b"precious"  # before: the model's bytes
    finally:
        os.unlink(link)
        os.rmdir(planted)


def test_the_reader_maps_only_private_regular_files_of_its_own_user(folder):
    root = tensor_segment.SEGMENT_DIR
    name = tensor_segment.segment_name(folder, 1)
    entries = tensor_segment.write_segment(name, {"x": np.arange(4, dtype=np.float32)})
    path = os.path.join(root, name)
    for mode in (0o620, 0o602, 0o666):  # group or others may write it
        os.chmod(path, mode)
        with pytest.raises(UnsafeSegment, match="open to others"):
            tensor_segment.read_segment(name, entries)
    os.chmod(path, 0o640)
    assert tensor_segment.read_segment(name, entries)["x"].tolist() == [0, 1, 2, 3]
    os.chmod(os.path.join(root, folder), 0o755)  # the folder must stay private
    with pytest.raises(UnsafeSegment, match="its folder"):
        tensor_segment.read_segment(name, entries)
    os.chmod(os.path.join(root, folder), 0o700)
    alias = tensor_segment.segment_name(folder, 2)  # a link to a good segment is refused, not followed
    os.symlink(path, os.path.join(root, alias))
    with pytest.raises(UnsafeSegment, match="symbolic link"):
        tensor_segment.read_segment(alias, entries)
    other = tensor_segment.segment_name(folder, 3)
    os.mkdir(os.path.join(root, other))
    with pytest.raises(UnsafeSegment, match="not a regular file"):
        tensor_segment.read_segment(other, entries)
    linked_folder = folder[:-8] + "linkedxx"  # a folder name that is a link to a private folder
    os.symlink(os.path.join(root, folder), os.path.join(root, linked_folder))
    try:
        with pytest.raises(UnsafeSegment, match="its folder is a link"):
            tensor_segment.read_segment(name.replace(folder, linked_folder), entries)
    finally:
        os.unlink(os.path.join(root, linked_folder))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_the_reader_refuses_a_segment_or_folder_another_user_owns(folder):
    root = tensor_segment.SEGMENT_DIR
    name = tensor_segment.segment_name(folder, 1)
    entries = tensor_segment.write_segment(name, {"x": np.arange(4, dtype=np.float32)})
    os.chown(os.path.join(root, name), 65534, 65534)
    with pytest.raises(UnsafeSegment, match="owned by another user"):
        tensor_segment.read_segment(name, entries)
    os.chown(os.path.join(root, name), 0, 0)
    os.chown(os.path.join(root, folder), 65534, 65534)
    with pytest.raises(UnsafeSegment, match="owned by another user"):
        tensor_segment.read_segment(name, entries)
    os.chown(os.path.join(root, folder), 0, 0)
    assert tensor_segment.read_segment(name, entries)["x"].tolist() == [0, 1, 2, 3]


def test_a_link_planted_at_a_versions_temporary_folder_is_not_written_through(tiny_state, tmp_path):
    """Before: the export's v<N>.tmp was rmtree'd (which skips a link) and then written through the link."""
    from drgrpo_jax.rollout.weight_push import WeightPublisher

    graphdef, params = tiny_state
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "v1.tmp").symlink_to(elsewhere)
    path = WeightPublisher(str(tmp_path / "weights"), graphdef).publish(params, 1)
    assert os.listdir(elsewhere) == [] and not os.path.islink(path) and "config.json" in os.listdir(path)


# ---------------------------------------------------------------------------------------------
# The pusher: one segment alive at a time, none after close or after a failed push
# ---------------------------------------------------------------------------------------------


class _Client:
    """Stands in for RolloutClient.update_weights_from_segment: records what it was asked, or fails."""

    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []

    def update_weights_from_segment(self, segment, tensors, version, *, rollback=False):
        assert os.path.isfile(os.path.join(tensor_segment.SEGMENT_DIR, segment))  # written before the call
        self.calls.append((segment, version, rollback))
        if self.fail:
            raise RolloutError("refused", status=400)


@pytest.fixture
def tiny_state(tiny_model):
    from flax import nnx

    from drgrpo_jax.models.pretrained import from_pretrained

    return nnx.split(from_pretrained(tiny_model), nnx.Param)


def test_the_pusher_keeps_only_the_last_segment_and_none_after_close_or_a_failed_push(tiny_state):
    graphdef, params = tiny_state
    client = _Client()
    with SegmentPusher(graphdef) as pusher:
        assert pusher.push(client, params, 1).startswith("shm:drgrpo_weights_")
        first = _segments()
        pusher.push(client, params, 2)
        assert len(first) == 1 and len(_segments()) == 1 and _segments() != first  # the previous segment is gone
        with pytest.raises(RolloutError):
            pusher.push(_Client(fail=True), params, 3)
        assert len(_segments()) == 1  # the failed push's segment is deleted; the loaded one stays for a restart
    assert _ours() == []  # the folder too
    assert [(v, r) for _, v, r in client.calls] == [(1, False), (2, False)]


def test_host_tensors_are_the_params_under_their_paths(tiny_state):
    graphdef, params = tiny_state
    from flax import nnx

    tensors = host_tensors(graphdef, params)
    flat = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}
    assert tensors.keys() == flat.keys() and "embed" in tensors
    for key in flat:
        np.testing.assert_array_equal(tensors[key], flat[key])


def test_a_merged_lora_push_sends_what_export_merged_writes(tiny_model, tmp_path):
    import jax
    from flax import nnx

    from drgrpo_jax.models.config import LoraSpec
    from drgrpo_jax.models.lora import add_adapters
    from drgrpo_jax.models.pretrained import from_pretrained
    from drgrpo_jax.rollout.weight_push import WeightPublisher

    model = add_adapters(from_pretrained(tiny_model), LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "down_proj")),
                         jax.random.key(1))
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, nnx.Param)
    adapters = _perturbed(adapters, 3)  # B starts at zero: make the merge matter
    tensors = host_tensors(graphdef, adapters, frozen)
    publisher = WeightPublisher(str(tmp_path), graphdef, lora=model.runtime.lora, push_merged=True)
    _, written = nnx.split(from_pretrained(publisher.export_merged(adapters, frozen, str(tmp_path / "m"))), nnx.Param)
    flat = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(written)}
    assert tensors.keys() == flat.keys()
    for key in flat:
        np.testing.assert_array_equal(tensors[key], flat[key], err_msg=key)
    base = host_tensors(graphdef, frozen)  # the unmerged base differs where adapters sit
    assert not np.array_equal(base["blocks/q_proj"], tensors["blocks/q_proj"])


# ---------------------------------------------------------------------------------------------
# The service: a shared-memory push serves exactly what a disk push serves
# ---------------------------------------------------------------------------------------------


def _perturbed(params, seed: int):
    import jax

    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [x + rng.normal(0, 0.05, x.shape).astype(x.dtype) for x in leaves])


def _generate(http, version: str) -> dict:
    body = {"input_ids": [[1, 5, 9, 13], [1, 7]], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "n": 2, "seed": 123}}
    answer = http.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    items = answer.json()
    assert {item["meta_info"]["weight_version"] for item in items} == {version}
    return {"ids": [item["output_ids"] for item in items],
            "logprobs": [[p[0] for p in item["meta_info"]["output_token_logprobs"]] for item in items]}


@pytest.mark.heavy  # an in-process service: the sampler compiles
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_shared_memory_push_serves_bit_identical_weights_and_logprobs_to_a_disk_push(tiny_model, tiny_state,
                                                                                       tmp_path, dtype, folder):
    import jax
    from fastapi.testclient import TestClient

    from drgrpo_jax.config.serve import ServeConfig
    from drgrpo_jax.rollout.weight_push import WeightPublisher
    from drgrpo_jax.serve.app import build_app
    from drgrpo_jax.serve.scheduler import Scheduler

    graphdef, params = tiny_state
    new = _perturbed(params, 1)
    scheduler = Scheduler(ServeConfig(model=tiny_model, dtype=dtype))
    try:
        http = TestClient(build_app(scheduler), base_url="http://127.0.0.1")
        before = _generate(http, "0")
        path = WeightPublisher(str(tmp_path / "weights"), graphdef).publish(new, 1)
        answer = http.post("/update_weights_from_disk", json={"model_path": path, "weight_version": 1})
        assert answer.status_code == 200, answer.text
        by_disk, disk_state = _generate(http, "1"), jax.device_get(jax.tree.leaves(scheduler.weights.state))
        name = tensor_segment.segment_name(folder, "2.0")
        entries = tensor_segment.write_segment(name, host_tensors(graphdef, new))
        try:
            answer = http.post("/update_weights_from_tensor", json={
                "segment": name, "tensors": [e.to_json() for e in entries], "weight_version": 2})
        finally:
            tensor_segment.remove_segment(name)  # the service copied the tensors out: the segment may go now
        assert answer.status_code == 200 and answer.json()["weight_version"] == "2", answer.text
        by_shm, shm_state = _generate(http, "2"), jax.device_get(jax.tree.leaves(scheduler.weights.state))
        assert by_shm == by_disk and by_shm != before
        for a, b in zip(disk_state, shm_state, strict=True):
            assert a.dtype == b.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(a, b)
        assert http.get("/get_model_info").json()["weight_version"] == "2"
    finally:
        scheduler.close()


@pytest.mark.heavy  # an in-process service
def test_bad_tensor_updates_are_refused_and_the_old_weights_serve_on(tiny_model, tiny_state, folder):
    from fastapi.testclient import TestClient

    from drgrpo_jax.config.serve import ServeConfig
    from drgrpo_jax.serve.app import build_app
    from drgrpo_jax.serve.scheduler import Scheduler

    graphdef, params = tiny_state
    tensors = host_tensors(graphdef, params)
    scheduler = Scheduler(ServeConfig(model=tiny_model))
    name = tensor_segment.segment_name(folder, "5.0")
    try:
        http = TestClient(build_app(scheduler), base_url="http://127.0.0.1")
        entries = [e.to_json() for e in tensor_segment.write_segment(name, tensors)]

        def push(**body):
            return http.post("/update_weights_from_tensor", json={"segment": name, "tensors": entries,
                                                                   "weight_version": 5} | body)

        cases = {"is missing": push(tensors=entries[1:]),
                 "not a parameter": push(tensors=[*entries, dict(entries[0], name="extra")]),
                 "shape": push(tensors=[dict(entries[0], shape=[1])] + entries[1:]),
                 "no such shared-memory segment": push(segment=tensor_segment.segment_name(folder, "6.0")),
                 "not a weight segment name": push(segment="../../etc/passwd")}
        for reason, answer in cases.items():
            assert answer.status_code == 400 and reason in answer.json()["message"], (reason, answer.text)
        assert scheduler.weights.version == "0"
        assert push().status_code == 200 and scheduler.weights.version == "5"
        older = push(weight_version=4)
        assert older.status_code == 400 and "older" in older.json()["message"]
        assert push(weight_version=4, allow_rollback=True).status_code == 200 and scheduler.weights.version == "4"
    finally:
        tensor_segment.remove_segment(name)
        scheduler.close()


# ---------------------------------------------------------------------------------------------
# Which path a run's pushes take
# ---------------------------------------------------------------------------------------------

BASE = ["model.path=m", "data.source=jsonl", "data.path=p.jsonl"]


@pytest.mark.parametrize("overrides, local_child, mode", [
    ([], True, "shm"),
    (["rollout.weight_sync=disk"], True, "disk"),
    (["rollout.urls=[http://h:1]"], False, "disk"),
    (["model.lora.rank=4"], True, "disk"),  # adapter pushes are PEFT folders
    (["model.lora.rank=4", "model.lora.push=merged"], True, "shm"),
    (["run.weights_dir=/tmp/mirror"], True, "disk"),
])
def test_auto_sends_the_child_shared_memory_and_everything_else_a_folder(overrides, local_child, mode):
    assert sync_mode(load_config(None, BASE + overrides), local_child=local_child) == mode


@pytest.mark.parametrize("overrides, reason", [
    (["rollout.urls=[http://h:1]"], "rollout.urls"),
    (["model.lora.rank=4"], "model.lora.push=merged"),
    (["run.weights_dir=/tmp/mirror"], "run.weights_dir"),
])
def test_forcing_shm_where_a_folder_is_needed_is_a_config_error(overrides, reason):
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync.*" + reason.replace(".", r"\.")):
        load_config(None, BASE + ["rollout.weight_sync=shm", *overrides])


@pytest.mark.subprocess  # the trainer's real child service, killed once
def test_a_child_restarted_after_a_shared_memory_push_reloads_the_segment(tiny_model, tiny_state):
    import signal
    import time

    from drgrpo_jax.rollout.client import RolloutClient
    from drgrpo_jax.rollout.local_service import LocalServer

    graphdef, params = tiny_state
    with LocalServer(tiny_model) as server, RolloutClient([server.url], local_server=server) as client, \
            SegmentPusher(graphdef) as pusher:
        pusher.push(client, _perturbed(params, 2), 3)
        first = client.generate([[1, 5, 9]], 2, max_new_tokens=6, seed=7, expected_version=3)
        os.kill(server._process.pid, signal.SIGKILL)
        while server.running:
            time.sleep(0.05)
        again = client.generate([[1, 5, 9]], 2, max_new_tokens=6, seed=7, expected_version=3)
        assert client.service_restarts == 1 and again.weight_versions == ("3", "3")
        np.testing.assert_array_equal(again.response_ids, first.response_ids)
        np.testing.assert_array_equal(again.behaviour_logprobs, first.behaviour_logprobs)
    assert _ours() == []


def test_auto_falls_back_to_disk_and_shm_fails_by_name_when_shared_memory_is_too_small(monkeypatch, tiny_state):
    import jax

    from drgrpo_jax.rollout.weight_push import check_room

    _, params = tiny_state
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    auto, forced = load_config(None, BASE), load_config(None, BASE + ["rollout.weight_sync=shm"])
    monkeypatch.setattr(tensor_segment, "free_bytes", lambda: 2 * size)
    assert check_room(auto, "shm", params) == "shm" and check_room(forced, "shm", params) == "shm"
    monkeypatch.setattr(tensor_segment, "free_bytes", lambda: 2 * size - 1)  # the loaded version and the next
    assert check_room(auto, "shm", params) == "disk" and check_room(auto, "disk", params) == "disk"
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync: shm: /dev/shm has .* MiB free"):
        check_room(forced, "shm", params)
