"""rollout.inflight_updates (issue #56): the config key and its rules, the trainer's child service started with
--inflight-updates, services of rollout.urls checked for it, the queued rounds held by a checkpoint (not re-drawn:
which token got which version depends on timing), and end to end a K = 2 run killed after a checkpoint whose resumed
steps train on exactly the rounds it saved, and a run whose pushes reach its rounds mid-decode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from drgrpo_jax.checkpoint import Checkpointer
from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.rollout.record import HostCounters, ScoredRollout
from drgrpo_jax.train.collect import Round
from drgrpo_jax.train.metrics import staleness_metrics
from drgrpo_jax.train.rollout_queue import (
    PendingRound,
    Prefetcher,
    QueueRecord,
    check_queue,
    held_contents,
    held_rounds,
    queue_length,
)
from drgrpo_jax.train.setup import check_inflight, child_service_args

from support.paths import TESTS
from support.trainer_runs import start_trainer, trainer_env, trainer_overrides

BASE = ["model.path=m", "data.source=jsonl", "data.path=p.jsonl"]
INFLIGHT = ["rollout.async=true", "rollout.max_staleness=2", "algorithm.tis_cap=2.0", "rollout.inflight_updates=true"]


# ---------------------------------------------------------------------------------------------
# The key and its rules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, reason", [
    (["rollout.inflight_updates=true"], "needs rollout.async=true"),
    (INFLIGHT + ["rollout.urls=[http://a:1]", "rollout.engine=sglang"], "needs rollout.engine=ours"),
    (INFLIGHT + ["rollout.urls=[http://a:1]", "mesh.num_processes=2", "mesh.coordinator_address=h:1"],
     "one process only"),
])
def test_inflight_config_errors_name_the_key(overrides, reason):
    with pytest.raises(ConfigError) as error:
        load_config(None, BASE + overrides)
    assert error.value.key == "rollout.inflight_updates" and reason in error.value.reason


def test_the_child_service_runs_with_inflight_updates_only_when_asked():
    assert "--inflight-updates" in child_service_args(load_config(None, BASE + INFLIGHT))
    assert "--inflight-updates" not in child_service_args(load_config(None, BASE + INFLIGHT[:3]))
    args = child_service_args(load_config(None, BASE))
    assert args[args.index("--admission-share") + 1] == "0"  # the trainer's own service refuses none of its rounds


class _Services:
    """A client's view of services whose /get_model_info says (or not) that they take in-flight updates."""

    def __init__(self, infos: list[dict]):
        self.urls, self._infos = tuple(f"http://s{i}:1" for i in range(len(infos))), infos

    def model_info(self, index: int = 0) -> dict:
        return self._infos[index]


def test_services_of_rollout_urls_must_report_inflight_updates():
    check_inflight(_Services([{"inflight_updates": True}] * 2))
    for infos in ([{"inflight_updates": True}, {"inflight_updates": False}], [{}]):  # off, or an older service
        with pytest.raises(ConfigError) as error:
            check_inflight(_Services(infos))
        assert error.value.key == "rollout.inflight_updates" and "--inflight-updates" in error.value.reason
        assert f"s{len(infos) - 1}" in error.value.reason


@pytest.mark.parametrize("saved, now, was", [(True, False, "true, this run has false"),
                                             (False, True, "false, this run has true")])
def test_a_checkpoint_of_the_other_mode_is_refused_naming_the_key(saved, now, was):
    host = QueueRecord(4, 0, rollout_queue=queue_length(True, 2), inflight_updates=saved)
    with pytest.raises(ConfigError) as error:
        check_queue(host, True, 2, now)
    assert error.value.key == "rollout.inflight_updates" and was in error.value.reason
    check_queue(host, True, 2, saved)  # the same mode resumes


# ---------------------------------------------------------------------------------------------
# A checkpoint holds the queued rounds
# ---------------------------------------------------------------------------------------------


def _share(seed: int, versions: list[int]) -> tuple[ScoredRollout, HostCounters]:
    """A scored round of 2 prompts x 2 responses whose tokens carry two versions (a push landed mid-response)."""
    rng = np.random.default_rng(seed)
    mask = np.arange(6)[None, :] < np.asarray([6, 4, 5, 3])[:, None]
    token_versions = np.where(mask, np.where(np.arange(6)[None, :] < 2, versions[0], versions[1]), -1)
    share = ScoredRollout.from_prompts(
        ("e0", "e1"), [[1, 2], [3]], response_ids=rng.integers(1, 50, (4, 6)).astype(np.int32) * mask,
        behaviour_logprobs=(-rng.random((4, 6)) * mask).astype(np.float32), response_mask=mask,
        lengths=mask.sum(1).astype(np.int32), truncated=np.asarray([True, False, False, False]),
        weight_versions=np.full(4, versions[0], np.int64),
        token_versions=token_versions.astype(np.int64), components=rng.random((4, 2)).astype(np.float32))
    counters = HostCounters(("f", "g"), 1.5, 0.25, np.asarray([0, 1]), np.asarray([2, 0]), ("g failed",))
    return share, counters


def test_a_checkpoint_holds_the_queued_rounds_rows_and_restores_them(tmp_path):
    shares = [_share(0, [3, 4]), _share(1, [4, 5])]
    with Prefetcher() as prefetcher:
        queue = [PendingRound(Round(5 + i, 0, (), [], 10 + 4 * i), prefetcher.submit(lambda s=s: s), 3 + i)
                 for i, s in enumerate(shares)]
        tree, fields = held_contents(queue)
    host = QueueRecord(5, 10, 2, stream_position=18, **fields).host()
    assert host["inflight_updates"] is True and host["round_positions"] == [10, 14]
    with Checkpointer(tmp_path / "ck", save_every=1, keep=2) as checkpointer:
        checkpointer.save(5, {"w": np.ones(2)}, host, rounds=tree)
        restored = checkpointer.restore_latest({"w": np.zeros(2)}, rounds=True)
    queued = held_rounds(QueueRecord.from_host(restored.host), restored.rounds)
    assert queued.positions == (10, 14) and queued.stream_position == 18 and queued.params == ()
    for held, (share, counters) in zip(queued.held, shares, strict=True):
        assert held.rows.keys() == share.row_arrays().keys()
        for name, value in share.row_arrays().items():
            np.testing.assert_array_equal(held.rows[name], value, err_msg=name)
            assert held.rows[name].dtype == value.dtype, name
        assert held.counters.reward_functions == counters.reward_functions
        assert held.counters.error_messages == counters.error_messages
        assert held.counters.metrics() == counters.metrics()
        assert (held.counters.rollout_seconds, held.counters.reward_seconds) == (1.5, 0.25)
    # the tokens keep their own versions: the staleness metrics count them as the saved run did
    again = ScoredRollout.from_prompts(("e0", "e1"), [[1, 2], [3]], **queued.held[0].rows)
    assert staleness_metrics(5, again, 2) == staleness_metrics(5, shares[0][0], 2)


def test_an_empty_queue_is_held_as_none(tmp_path):
    tree, fields = held_contents([])
    with Checkpointer(tmp_path / "ck", save_every=1, keep=2) as checkpointer:
        checkpointer.save(2, {"w": np.ones(2)}, QueueRecord(2, 8, 2, stream_position=8, **fields).host(), rounds=tree)
        restored = checkpointer.restore_latest({"w": np.zeros(2)}, rounds=True)
    assert held_rounds(QueueRecord.from_host(restored.host), restored.rounds).held == ()


# ---------------------------------------------------------------------------------------------
# End to end: K = 2 with in-flight updates, killed after a checkpoint and resumed
# ---------------------------------------------------------------------------------------------


def _step_rows(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


@pytest.mark.subprocess  # the trainer CLI and its generation service (with --inflight-updates)
@pytest.mark.slow  # a trainer run killed after its first checkpoint, then resumed (~2 minutes on 2 busy cores)
def test_a_killed_inflight_run_resumes_on_exactly_the_rounds_its_checkpoint_holds(tmp_path, tiny_model,
                                                                                   prompts_file):
    output_dir = tmp_path / "run"
    overrides = trainer_overrides(tiny_model, prompts_file, output_dir, steps=4) + INFLIGHT + ["train.eval_every=0"]
    process = start_trainer(overrides)
    while not (output_dir / "checkpoints" / "2").exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    saved = ocp.CheckpointManager(output_dir / "checkpoints", item_handlers={
        "host": ocp.JsonCheckpointHandler(), "rounds": ocp.PyTreeCheckpointHandler()}).restore(
        2, args=ocp.args.Composite(host=ocp.args.JsonRestore(), rounds=ocp.args.PyTreeRestore()))
    assert saved["host"]["inflight_updates"] is True and int(saved["rounds"]["count"]) == 2  # steps 3 and 4's
    resumed = start_trainer(overrides)
    _, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stderr[-3000:]
    rows = _step_rows(output_dir)
    assert [r["step"] for r in rows][-2:] == [3, 4]
    for row, i in zip(rows[-2:], (0, 1)):  # each resumed step trained on the saved round, as it was sampled
        round_ = ScoredRollout.from_prompts(["e"] * 4, [[1]] * 4, **saved["rounds"][f"round{i}"]["rows"])
        assert row["response_length_mean"] == pytest.approx(float(round_.lengths.mean()))
        assert row["weight_version"] == int(round_.weight_versions.min())
        for name, value in staleness_metrics(row["step"] - 1, round_, 2).items():
            assert row[name] == pytest.approx(value), name
        assert 0 <= row["staleness"] <= 2


@pytest.mark.subprocess  # a generation service whose batches wait for the next push, and the trainer CLI against it
@pytest.mark.slow  # about a minute on 2 cores
def test_pushes_landing_mid_round_train_on_responses_of_two_versions(tmp_path, tiny_model, prompts_file):
    port_file = tmp_path / "port"
    service = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "support", "paused_service.py"), "--model", tiny_model, "--port", "0",
         "--port-file", str(port_file), "--inflight-updates", "--cancel-check-steps", "4"],
        env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not port_file.exists() or not port_file.read_text().strip():
            assert service.poll() is None, service.communicate()[1][-3000:]
            time.sleep(0.1)
        output_dir = tmp_path / "run"
        overrides = trainer_overrides(tiny_model, prompts_file, output_dir, steps=5) + INFLIGHT + [
            "train.eval_every=0", f"rollout.urls=[http://127.0.0.1:{port_file.read_text().strip()}]"]
        trainer = start_trainer(overrides)
        _, stderr = trainer.communicate(timeout=900)
        assert trainer.returncode == 0, stderr[-3000:]
    finally:
        service.terminate()
        service.communicate(timeout=60)
    rows = _step_rows(output_dir)
    crossed = [row for row in rows if row["responses_crossing_update"] > 0]
    assert crossed, [row["responses_crossing_update"] for row in rows]
    for row in crossed:  # the round's tokens at two versions, both within the bound; the step trained on them
        assert sum(row[f"tokens_at_staleness/{k}"] > 0 for k in range(3)) >= 2, row
        assert 0 <= row["staleness"] <= 2 and np.isfinite(row["loss"])
