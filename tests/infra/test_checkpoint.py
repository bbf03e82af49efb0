"""Checkpoints: exact round trip (values, dtypes, asked shardings), cadence and retention, atomicity under SIGKILL,
preemption (SIGTERM in one process, orbax's sync point across two)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.checkpoint import RESTART_EXIT_CODE, Checkpointer, device_checksums, host_checksums
from drgrpo_jax.errors import ConfigError

from support.gcs_emulator import BUCKET, gcs_emulator
from support.two_processes import start_two_processes


def _train_state(seed: int, vocab: int = 16):
    """A small train state shaped like the trainer's: params, Adam state, step, typed PRNG key."""
    key = jax.random.key(seed)
    params = {
        "embed_VD": jax.random.normal(key, (vocab, 8), jnp.float32),
        "norm_D": jnp.linspace(0.5, 1.5, 8).astype(jnp.bfloat16),
    }
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)  # non-trivial moments and count
    params = optax.apply_updates(params, updates)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(seed), "rng": jax.random.fold_in(key, 7)}


def _assert_same(restored, expected):
    leaves_r, tree_r = jax.tree.flatten(restored)
    leaves_e, tree_e = jax.tree.flatten(expected)
    assert tree_r == tree_e
    for got, want in zip(leaves_r, leaves_e):
        assert got.dtype == want.dtype and got.shape == want.shape
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_round_trip_is_exact_with_asked_shardings(tmp_path):
    state = _train_state(3)
    host = {"data_position": 11, "weight_version": 4, "note": "x"}
    with Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as checkpointer:
        assert checkpointer.save(3, state, host)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    abstract = jax.eval_shape(lambda: _train_state(3))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    shardings["params"]["embed_VD"] = NamedSharding(mesh, P("fsdp", None))
    with Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as checkpointer:
        restored = checkpointer.restore_latest(abstract, shardings)
    assert restored.step == 3 and restored.host == host
    _assert_same(restored.state, state)
    assert restored.state["params"]["embed_VD"].sharding == NamedSharding(mesh, P("fsdp", None))
    assert restored.state["params"]["norm_D"].sharding == NamedSharding(mesh, P())
    # The restored RNG continues the same stream.
    np.testing.assert_array_equal(
        jax.random.uniform(jax.random.fold_in(restored.state["rng"], 1), (3,)),
        jax.random.uniform(jax.random.fold_in(state["rng"], 1), (3,)),
    )


def test_cadence_force_and_retention(tmp_path):
    state = _train_state(0)
    with Checkpointer(tmp_path, save_every=2, keep=2) as checkpointer:
        assert checkpointer.restore_latest(jax.eval_shape(lambda: state)) is None
        assert checkpointer.latest_host_state() is None
        saved = [step for step in range(1, 8)
                 if checkpointer.save(step, state, {"data_position": step}, force=step == 7)]
        assert saved == [2, 4, 6, 7]
        assert not checkpointer.save(7, state, {"data_position": 7}, force=True)  # the end right after a save
        assert checkpointer.all_steps() == [6, 7] and checkpointer.latest_step() == 7
        assert checkpointer.restore(6, state).host == {"data_position": 6}
        assert checkpointer.latest_host_state() == {"data_position": 7}  # without a tree to restore into


def _array_files(step_folder) -> list[str]:
    """The state's array data files, largest first."""
    files = [os.path.join(folder, name) for folder, _, names in os.walk(step_folder / "state") for name in names]
    return sorted((path for path in files if f"{os.sep}d{os.sep}" in path), key=os.path.getsize, reverse=True)


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _damage(step_folder, how: str) -> None:
    """Truncates the host JSON ("json": what issue #44 met) or the array data files ("arrays") of a saved step, or
    flips 4 KB in the middle of its largest array file ("flip": what issue #64 met)."""
    if how == "flip":
        path = _array_files(step_folder)[0]
        middle = os.path.getsize(path) // 2
        with open(path, "r+b") as f:
            f.seek(middle)
            block = f.read(4096)
            f.seek(middle)
            f.write(bytes(byte ^ 0xFF for byte in block))
        return
    for folder, _, files in os.walk(step_folder):
        for name in files:
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, step_folder).split(os.sep)
            if (how == "json" and parts == ["host", "metadata"]) or (how == "arrays" and "d" in parts[:-1]):
                _truncate(path)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no read left behind (#64)
@pytest.mark.parametrize("how", ["json", "arrays", "flip"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_with_one_line(tmp_path, how, caplog):
    states = {step: _train_state(step, vocab=8192) for step in (1, 2, 3)}  # embed_VD: 256 KB, most of the file
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer:
        for step, state in states.items():
            checkpointer.save(step, state, {"data_position": step})
    _damage(tmp_path / "3", how)
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer, caplog.at_level("WARNING", "drgrpo_jax"):
        restored = checkpointer.restore_latest(jax.eval_shape(lambda: states[3]))
        # main: JSONDecodeError / orbax error; flipped, step 3 restored and trained on (#64)
        assert restored.step == 2 and restored.host == {"data_position": 2}
        _assert_same(restored.state, states[2])
        assert checkpointer.all_steps() == [1, 2] and (tmp_path / "3.damaged").is_dir()
        assert checkpointer.save(3, states[3], {"data_position": 3})  # the run saves step 3 again
    lines = [r.getMessage() for r in caplog.records if r.name == "drgrpo_jax.checkpoint"]
    assert len(lines) == 1 and "step 3" in lines[0] and "damaged" in lines[0] and "from step 2" in lines[0], lines
    assert "\n" not in lines[0]
    if how == "flip":
        assert re.search(r"CorruptCheckpoint: state array \S+ differs from the checksum saved with it", lines[0])


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # what a read left behind reports
@pytest.mark.parametrize("damage", [_truncate, os.remove], ids=["truncated", "missing"])
def test_a_failed_restore_leaves_no_read_to_complete_into_a_closed_event_loop(tmp_path, damage, caplog):
    """orbax closes its restore's event loop when the first read fails, and the reads still in flight then
    completed into the closed loop: "Event loop is closed", an ignored exception each (#64). The small array's
    file is damaged, so its read fails while the large array's is still being read; three damaged checkpoints make
    three such failures before step 1 restores."""
    state = {"large": jnp.ones((2048, 2048), jnp.float32), "small": jnp.arange(64 * 1024, dtype=jnp.float32)}
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer:
        for step in (1, 2, 3, 4):
            checkpointer.save(step, state, {"data_position": step})
    for step in (2, 3, 4):
        damage(_array_files(tmp_path / str(step))[1])  # the small array's: [0] holds the large one
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer, caplog.at_level("WARNING", "drgrpo_jax"):
        restored = checkpointer.restore_latest(jax.eval_shape(lambda: state))
    assert restored.step == 1 and caplog.text.count("is damaged") == 3
    _assert_same(restored.state, state)


def test_checksums_are_the_same_for_any_sharding_and_see_one_changed_element():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    key = jax.random.key(0)
    tree = {"f32": jax.random.normal(key, (8, 12)), "bf16": jnp.arange(16, dtype=jnp.bfloat16).reshape(4, 4),
            "flags": jnp.array([True, False, True]), "count": jnp.int32(7), "rng": jax.random.fold_in(key, 1)}
    checksums = device_checksums(tree)
    assert set(checksums) == set(tree) and checksums["bf16"].startswith("bfloat16 ")
    for spec in (P("fsdp", None), P(None, "fsdp"), P("data", "fsdp")):
        placed = dict(tree, f32=jax.device_put(tree["f32"], NamedSharding(mesh, spec)))
        assert device_checksums(placed) == checksums
    for name, changed in [("f32", tree["f32"].at[5, 7].add(1e-6)), ("bf16", tree["bf16"].T),
                          ("flags", ~tree["flags"]), ("count", jnp.int32(8)), ("rng", jax.random.fold_in(key, 2))]:
        assert device_checksums(dict(tree, **{name: changed}))[name] != checksums[name], name
    rounds = {"count": np.asarray(2, np.int64), "tokens": np.arange(6, dtype=np.int64).reshape(2, 3)}
    assert host_checksums(rounds) != host_checksums(dict(rounds, tokens=rounds["tokens"] + (1 << 40)))


def test_a_flipped_array_of_the_saved_rounds_falls_back_too(tmp_path, caplog):
    rounds = {"count": np.asarray(1, np.int64), "round0": {"rows": {"tokens": np.arange(64 * 1024, dtype=np.int32)}}}
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer:
        for step in (1, 2):
            checkpointer.save(step, {"w": jnp.ones(4)}, {"data_position": step}, rounds=rounds)
    path = max((os.path.join(folder, name) for folder, _, names in os.walk(tmp_path / "2" / "rounds")
                for name in names if f"{os.sep}d{os.sep}" in os.path.join(folder, name)), key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x01\x02\x03\x04")
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer, caplog.at_level("WARNING", "drgrpo_jax"):
        restored = checkpointer.restore_latest({"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, rounds=True)
    assert restored.step == 1
    np.testing.assert_array_equal(restored.rounds["round0"]["rows"]["tokens"], rounds["round0"]["rows"]["tokens"])
    assert "rounds array round0/rows/tokens differs" in caplog.text


@pytest.fixture
def bucket(monkeypatch):
    with gcs_emulator() as (_, env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield f"gs://{BUCKET}"


@pytest.mark.slow  # the emulator answers one request at a time: ~45 s on 2 busy cores
def test_a_bucket_holds_checkpoints_keeps_the_newest_and_sets_a_damaged_one_aside(bucket, caplog):
    """A gs:// folder: orbax saves and restores through the bucket, keeps the newest `keep`, and a damaged latest
    checkpoint is renamed aside there (etils.epath) and the previous one restored."""
    from etils import epath

    states = {step: _train_state(step) for step in (1, 2, 3)}
    directory = f"{bucket}/run/checkpoints"
    with Checkpointer(directory, save_every=1, keep=2) as checkpointer:
        assert checkpointer.directory == directory
        for step, state in states.items():
            assert checkpointer.save(step, state, {"data_position": step})
        assert checkpointer.all_steps() == [2, 3]
    (epath.Path(directory) / "3" / "host" / "metadata").write_text("{")  # a truncated host JSON
    with Checkpointer(directory, save_every=1, keep=2) as checkpointer, caplog.at_level("WARNING", "drgrpo_jax"):
        restored = checkpointer.restore_latest(jax.eval_shape(lambda: states[3]))
        assert restored.step == 2 and restored.host == {"data_position": 2}
        _assert_same(restored.state, states[2])
        assert checkpointer.all_steps() == [2]
    assert sorted(p.name for p in epath.Path(directory).iterdir()) == ["2", "3.damaged"]


def test_every_checkpoint_damaged_raises_the_newest_error(tmp_path):
    state = _train_state(1)
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer:
        checkpointer.save(1, state, {"data_position": 1})
    _damage(tmp_path / "1", "json")
    with Checkpointer(tmp_path, save_every=1, keep=5) as checkpointer, pytest.raises(Exception):  # noqa: B017
        checkpointer.restore_latest(jax.eval_shape(lambda: state))


def test_resume_rules(tmp_path):
    with Checkpointer(tmp_path / "empty", save_every=1, keep=1) as checkpointer:
        assert checkpointer.should_resume(None) is False and checkpointer.should_resume(False) is False
        with pytest.raises(ConfigError, match=r"^train.resume: true, but .* holds no checkpoint$"):
            checkpointer.should_resume(True)
    with Checkpointer(tmp_path / "full", save_every=1, keep=1) as checkpointer:
        checkpointer.save(2, _train_state(0), {})
        assert checkpointer.should_resume(None) is True and checkpointer.should_resume(True) is True
        with pytest.raises(ConfigError, match=r"^train.resume: false, but .* up to step 2;"):
            checkpointer.should_resume(False)


CRASH_MID_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from drgrpo_jax.checkpoint import Checkpointer

    checkpointer = Checkpointer(sys.argv[1], save_every=1, keep=3)
    checkpointer.save(1, {"w": jnp.full((4,), 1.0)}, {"data_position": 1})

    async def die(self):  # the data of step 2 is written; the process dies before the commit rename
        os.kill(os.getpid(), signal.SIGKILL)

    atomicity.AtomicRenameTemporaryPath.finalize = die
    checkpointer.save(2, {"w": jnp.full((4,), 2.0)}, {"data_position": 2})
    """
)


@pytest.mark.subprocess  # a checkpointing process killed mid-save
def test_crash_mid_save_leaves_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    process = subprocess.run(
        [sys.executable, "-c", CRASH_MID_SAVE, str(directory)], env=env, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    assert any("tmp" in name for name in os.listdir(directory)), os.listdir(directory)  # died mid-save
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with Checkpointer(directory, save_every=1, keep=3) as checkpointer:
        assert checkpointer.all_steps() == [1]
        restored = checkpointer.restore_latest(abstract)
        assert restored.step == 1 and restored.host == {"data_position": 1}
        np.testing.assert_array_equal(restored.state["w"], np.full((4,), 1.0, np.float32))
        # The leftover is cleaned up and the same step can be saved again.
        assert checkpointer.save(2, {"w": jnp.full((4,), 2.0)}, {"data_position": 2})
        assert checkpointer.all_steps() == [1, 2]
    assert not any("tmp" in name for name in os.listdir(directory))


def test_a_compressed_checkpoint_of_an_earlier_version_restores(tmp_path, caplog):
    """Earlier versions saved the state with orbax's StandardSave (zstd) and no checksums; this one writes it
    uncompressed, with them."""
    import orbax.checkpoint as ocp

    state = {"w": jnp.arange(12.0).reshape(3, 4), "moments": {"mu": jnp.ones(5, jnp.bfloat16)}, "step": jnp.int32(7)}
    earlier = ocp.CheckpointManager(str(tmp_path), options=ocp.CheckpointManagerOptions(create=True),
                                    item_names=("state", "host"))
    earlier.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave({"step": 3})))
    earlier.wait_until_finished()
    earlier.close()

    checkpointer = Checkpointer(tmp_path, save_every=1, keep=2)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with caplog.at_level("WARNING", "drgrpo_jax"):
        restored = checkpointer.restore_latest(abstract)
        checkpointer.restore(3, abstract)
    assert restored is not None and restored.step == 3 and restored.host == {"step": 3}
    unchecked = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(unchecked) == 1 and "step 3" in unchecked[0] and "unchecked" in unchecked[0], caplog.text
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    checkpointer.save(4, restored.state, {"step": 4})  # and saves on into the same folder
    checkpointer.close()
    assert Checkpointer(tmp_path, save_every=1, keep=2).all_steps() == [3, 4]


@pytest.mark.subprocess
@pytest.mark.slow  # two trainer runs, each with its service child process (a few minutes on 2 busy cores)
def test_a_trainer_resumes_past_a_damaged_latest_checkpoint(tiny_model, prompts_file, tmp_path):
    """The whole resume: a run saved steps 2 and 4, step 4's host JSON was truncated; the next run names step 4 in
    one line, resumes from step 2, saves step 4 again and finishes."""
    from support.trainer_runs import start_trainer, trainer_overrides

    output_dir = tmp_path / "run"
    first = start_trainer(trainer_overrides(tiny_model, prompts_file, output_dir, steps=4))
    _, stderr = first.communicate(timeout=900)
    assert first.returncode == 0, stderr[-3000:]
    _damage(output_dir / "checkpoints" / "4", "json")
    resumed = start_trainer(trainer_overrides(tiny_model, prompts_file, output_dir, steps=4))
    _, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stderr[-3000:]  # main: exit 1, JSONDecodeError: Unterminated string ...
    lines = [line for line in stderr.splitlines() if "damaged" in line]
    assert len(lines) == 1 and "checkpoint step 4" in lines[0] and "resuming from step 2" in lines[0], lines
    assert "Traceback" not in stderr
    assert (output_dir / "checkpoints" / "4.damaged").is_dir() and (output_dir / "checkpoints" / "4").is_dir()


def test_sigterm_in_one_process_makes_the_next_asked_step_due_and_close_gives_the_signal_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path, save_every=10, keep=2, catch_sigterm=True) as checkpointer:
        assert not checkpointer.due(1) and not checkpointer.preempted(1)
        os.kill(os.getpid(), signal.SIGTERM)  # only sets a flag: the test process lives on
        assert not checkpointer.preempted(1)  # a step's answer is given once: every process asked at that step
        assert checkpointer.due(2) and checkpointer.preempted(2)
        assert checkpointer.save(2, {"w": jnp.ones(2)}, {"step": 2}) and checkpointer.all_steps() == [2]
    assert signal.getsignal(signal.SIGTERM) == before
    with Checkpointer(tmp_path, save_every=10, keep=2) as reader:  # evaluation's: SIGTERM stays as it was
        assert signal.getsignal(signal.SIGTERM) == before and not reader.preempted(3)


@pytest.mark.subprocess  # two jax.distributed processes
def test_sigterm_to_one_process_saves_the_same_step_on_both_and_exits_with_the_restart_code(tmp_path):
    """XLA's preemption notifier takes SIGTERM once jax.distributed is up; orbax's sync point names one step to
    every process, both save it and stop with RESTART_EXIT_CODE."""
    procs = start_two_processes("preemption_worker.py", tmp_path)
    try:
        while not (tmp_path / "running").exists() and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [RESTART_EXIT_CODE] * 2, "\n".join(outputs)[-4000:]
    saved = {(tmp_path / f"saved_{i}").read_text() for i in range(2)}
    assert len(saved) == 1 and int(saved.pop()) > 2
    with Checkpointer(tmp_path / "checkpoints", save_every=1000, keep=2) as checkpointer:
        step = checkpointer.latest_step()
        assert checkpointer.all_steps() == [step] and (tmp_path / "saved_0").read_text() == str(step)
