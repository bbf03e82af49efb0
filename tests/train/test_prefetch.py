"""K-step-off rollouts (rollout.async, K = rollout.max_staleness): the config key, the staleness rule, the queue's
schedule under random producer and consumer delays, and end to end the versions each step trains on and exact
resumes after SIGKILL (the queued rounds re-drawn, not saved)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drgrpo_jax.config.load import dump_config, load_config
from drgrpo_jax.errors import ConfigError, StaleWeightsError
from drgrpo_jax.train.collect import Round
from drgrpo_jax.train.metrics import staleness_metrics
from drgrpo_jax.train.rollout_queue import (
    InFlight,
    PendingRound,
    Prefetcher,
    QueueRecord,
    admits,
    busy_seconds,
    check_fresh,
    check_queue,
    in_flight,
    push_waits_for,
    queue_length,
    resumed_stream_position,
    rounds_in_flight,
    sampled_ahead,
    sampler_version,
    saved_params,
)

from support.trainer_runs import kill_and_resume, services_of, start_trainer, trainer_overrides

BASE = ["model.path=m", "data.source=jsonl", "data.path=p.jsonl"]
ASYNC = ["rollout.async=true", "rollout.max_staleness=1", "algorithm.tis_cap=2.0"]

# ---------------------------------------------------------------------------------------------
# The config key (a Python keyword) and its rules
# ---------------------------------------------------------------------------------------------


def test_rollout_async_is_read_and_written_under_its_own_key(tmp_path):
    config = load_config(None, BASE + ASYNC)
    assert config.rollout.async_ is True and load_config(None, BASE).rollout.async_ is False
    text = dump_config(config)
    assert "  async: true" in text and "async_" not in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert load_config(path) == config
    path.write_text("rollout:\n  async: true\n  max_staleness: 1\nalgorithm:\n  tis_cap: 2.0\n")
    assert load_config(path, BASE).rollout.async_ is True


@pytest.mark.parametrize("overrides, key, reason", [
    (["rollout.async=true", "algorithm.tis_cap=2.0"], "rollout.max_staleness", ">= 1"),
    (["rollout.async=true", "rollout.max_staleness=1"], "algorithm.tis_cap", "must be set"),
    (["rollout.asyn=true"], "rollout.asyn", "did you mean rollout.async"),
])
def test_async_config_errors_name_the_key(overrides, key, reason):
    with pytest.raises(ConfigError) as error:
        load_config(None, BASE + overrides)
    assert error.value.key == key and reason in error.value.reason


def test_mis_high_also_corrects_the_lag():
    config = load_config(None, BASE + ["rollout.async=true", "rollout.max_staleness=1", "algorithm.mis_high=2.0"])
    assert config.rollout.async_


# ---------------------------------------------------------------------------------------------
# Staleness: a rollout more than max_staleness versions old is never trained on
# ---------------------------------------------------------------------------------------------


def test_check_fresh_reports_the_staleness_and_refuses_older_or_future_versions():
    assert check_fresh(np.array([3, 3]), 3, 0) == 0
    assert check_fresh(np.array([2, 3]), 3, 1) == 1
    with pytest.raises(StaleWeightsError, match="allows 3..3"):
        check_fresh(np.array([2, 3]), 3, 0)
    with pytest.raises(StaleWeightsError, match="versions 1..3"):
        check_fresh(np.array([1, 3]), 3, 1)
    with pytest.raises(StaleWeightsError):
        check_fresh(np.array([4]), 3, 1)  # a version the trainer has not pushed


def test_a_pending_rounds_error_waits_for_its_step():
    def fails():
        raise RuntimeError("service gone")

    with Prefetcher() as prefetcher:
        pending = PendingRound(Round(1, 0, (), [], 0), prefetcher.submit(fails))
        pending.wait()  # returns: the error belongs to the step that takes the round
        assert isinstance(pending.share(), RuntimeError)
        with pytest.raises(RuntimeError, match="service gone"):
            pending.future.result()
        done = PendingRound(Round(2, 0, (), [[1]], 5), prefetcher.submit(lambda x: x + 1, 41))
        done.wait()
        assert done.share() == 42 and done.data_position == 5 and done.round.step == 2
    assert isinstance(done.future, concurrent.futures.Future)


# ---------------------------------------------------------------------------------------------
# The queue's schedule: pure functions, driven under random delays
# ---------------------------------------------------------------------------------------------


def test_round_t_is_sampled_k_versions_back_and_a_checkpoint_holds_the_next_k():
    assert [sampler_version(t, 1) for t in range(4)] == [0, 0, 1, 2]  # one-step-off
    assert [sampler_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]
    assert list(rounds_in_flight(3, 2, 10)) == [3, 4] and list(rounds_in_flight(9, 2, 10)) == [9]
    assert list(sampled_ahead(9, 2)) == [9, 10]  # uncapped: a run given more steps re-draws round 10 too
    assert admits(1, 3, 2) and not admits(0, 3, 2) and not admits(4, 3, 2)
    assert push_waits_for([1, 2, 2], 2) == [1, 2] and push_waits_for([3], 2) == []
    assert busy_seconds([(0.0, 1.0), (2.0, 5.0)], 0.5, 3.0) == pytest.approx(1.5)


def _simulate(k: int, steps: int, seconds: dict[str, list[float]], *, deferred: bool, start: int = 0) -> dict:
    """The loop's timeline (train_one_step) in simulated seconds, with the schedule's functions. One producer runs
    its jobs in submission order (rounds `seconds["sample"][t]` long, extra rounds `["extra"][s]` (None: no
    extra round, no dynamic sampling), and with
    `deferred` the pushes, `["push"][s]`); the consumer takes round s, has its extra round sampled, launches round
    s+K, updates for `["update"][s]` and pushes: itself once its version's rounds are done (lockstep), or by
    queueing the push behind them (deferred). Returns what each step trained on, every sampling job, the service's
    versions by time, the queue depths and when the last step ended."""
    now, producer_free = 0.0, 0.0
    versions = [(0.0, start)]  # (time, the version the service holds from then on)
    queue: list[dict] = []  # oldest first
    jobs, trained, depths = [], {}, []

    def produce(duration: float, step: int, version: int) -> dict:
        nonlocal producer_free
        begin = max(now, producer_free)
        producer_free = begin + duration
        jobs.append({"step": step, "version": version, "start": begin, "end": producer_free})
        return jobs[-1]

    def push(version: int, duration: float) -> None:
        nonlocal now, producer_free
        if deferred:
            producer_free = max(now, producer_free) + duration
            versions.append((producer_free, version))
        else:
            now = max(now, producer_free) + duration
            versions.append((now, version))

    for t in rounds_in_flight(start, k, steps):  # prime: fresh, all by version 0; resumed, one version at a time
        if sampler_version(t, k) != versions[-1][1]:
            now = max(now, producer_free)
            push(sampler_version(t, k), 0.0)
        queue.append(produce(seconds["sample"][t], t, sampler_version(t, k)))
    if versions[-1][1] != start:
        now = max(now, producer_free)
        push(start, 0.0)
    for s in range(start, steps):
        taken = queue.pop(0)
        now = max(now, taken["end"])
        assert taken["step"] == s and admits(taken["version"], s, k), "whole rounds, in order, never too old"
        trained[s] = taken["version"]
        if seconds["extra"][s] is not None:  # dynamic sampling's extra round: at its step, by its version
            now = max(now, produce(seconds["extra"][s], s, s)["end"])
        if s + k < steps:
            queue.append(produce(seconds["sample"][s + k], s + k, sampler_version(s + k, k)))
        depths.append(len(queue))
        now += seconds["update"][s]
        if not deferred:
            now = max([now] + [queue[i]["end"] for i in push_waits_for([q["version"] for q in queue], s)])
        push(s + 1, seconds["push"][s])
    return {"trained": trained, "jobs": jobs, "versions": versions, "depths": depths, "end": now}


def _held(versions: list[tuple[float, int]], when: float) -> list[int]:
    """The versions the service holds at `when` (two when a push lands exactly then)."""
    return [v for i, (t, v) in enumerate(versions)
            if t <= when and (i + 1 == len(versions) or versions[i + 1][0] >= when)]


_SECONDS = st.floats(0.0, 10.0, allow_subnormal=False)


def _draw_seconds(data, size: int) -> dict[str, list]:
    """Random durations of each kind of work; a step has an extra round or none."""
    seconds = {key: data.draw(st.lists(_SECONDS, min_size=size, max_size=size)) for key in ("sample", "update", "push")}
    return {**seconds, "extra": data.draw(st.lists(st.none() | _SECONDS, min_size=size, max_size=size))}


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 4), steps=st.integers(1, 9), deferred=st.booleans(), data=st.data())
def test_staleness_never_exceeds_k_under_random_producer_and_consumer_delays(k, steps, deferred, data):
    seconds = _draw_seconds(data, steps + k)
    run = _simulate(k, steps, seconds, deferred=deferred)
    assert sorted(run["trained"]) == list(range(steps))  # every step trains once, on one whole round
    assert all(0 <= s - v <= k for s, v in run["trained"].items())
    assert all(d <= k for d in run["depths"])
    for job in run["jobs"]:  # each job is sampled by its version alone: no push lands while it runs
        assert job["version"] in _held(run["versions"], job["start"])
        assert job["version"] in _held(run["versions"], job["end"])
    if steps > k:
        assert max(run["depths"]) == k


@settings(max_examples=200, deadline=None)
@given(k=st.integers(2, 4), steps=st.integers(1, 9), data=st.data())
def test_a_deferred_push_never_slows_a_step_and_absorbs_a_slow_round(k, steps, data):
    seconds = _draw_seconds(data, steps + k)
    assert _simulate(k, steps, seconds, deferred=True)["end"] <= _simulate(k, steps, seconds, deferred=False)["end"]


def test_a_slow_round_stalls_the_lockstep_push_but_not_the_deferred_one():
    # K = 2, 4 steps of 1 s updates; round 2 (sampled during step 0) takes 3 s, the others none.
    seconds = {"sample": [0, 0, 3, 0, 0, 0], "extra": [None] * 6, "update": [1] * 6, "push": [0] * 6}
    assert _simulate(2, 4, seconds, deferred=False)["end"] == 6.0  # step 0's push waits 2 s for round 2
    assert _simulate(2, 4, seconds, deferred=True)["end"] == 5.0  # step 1 trains meanwhile
    seconds["extra"] = [0] * 6  # dynamic sampling: step 1's extra round waits for version 1, behind round 2
    assert _simulate(2, 4, seconds, deferred=True)["end"] == 6.0


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 4), steps=st.integers(2, 9), deferred=st.booleans(), data=st.data())
def test_a_resumed_schedule_trains_each_step_on_the_uninterrupted_runs_round(k, steps, deferred, data):
    start = data.draw(st.integers(1, steps - 1))
    seconds = _draw_seconds(data, steps + k)
    whole = _simulate(k, steps, seconds, deferred=deferred)
    resumed = _simulate(k, steps, seconds, deferred=deferred, start=start)
    assert resumed["trained"] == {s: v for s, v in whole["trained"].items() if s >= start}


def test_the_checkpointed_queue_restores_its_positions_and_params():
    # a one-step-off checkpoint from before the queue
    one = in_flight(QueueRecord.from_host({"step": 3, "data_position": 7}), "params", 1)
    assert one == InFlight((7,), ("params",), 7) and resumed_stream_position(one, 1) == 8
    assert resumed_stream_position(one, 0) == 7  # the run had ended: nothing re-drawn
    assert saved_params(["a"], 1) == "a" and saved_params(["a", "b"], 2) == ("a", "b")
    # K = 2 with dynamic sampling: the queued rounds' prompts are not consecutive; one was not launched (the end).
    two = in_flight(QueueRecord.from_host({"step": 3, "data_position": 3, "round_positions": [3, 9],
                                           "stream_position": 9}), ("a", "b"), 2)
    assert two.positions == (3, 9) and two.params == ("a", "b")
    assert resumed_stream_position(two, 1) == 9 and resumed_stream_position(two, 2) == 10


@pytest.mark.parametrize(("saved", "async_", "k", "key", "message"), [
    (2, True, 1, "rollout.max_staleness", "saved with rollout.async=true with max_staleness=2, this run has "
     "rollout.async=true with max_staleness=1"),
    (0, True, 2, "rollout.async", "saved with rollout.async=false, this run has rollout.async=true"),
    (1, False, 1, "rollout.async", "saved with rollout.async=true with max_staleness=1, this run has "
     "rollout.async=false"),
])
def test_a_checkpoint_holding_another_queue_is_refused_naming_the_key(saved, async_, k, key, message):
    with pytest.raises(ConfigError, match=key) as error:
        check_queue(QueueRecord(4, 0, rollout_queue=saved), async_, k)
    assert message in str(error.value) and "step 4" in str(error.value)


def test_a_checkpoint_holding_this_runs_queue_or_from_before_the_key_resumes():
    check_queue(QueueRecord(4, 0, rollout_queue=queue_length(True, 2)), True, 2)
    check_queue(QueueRecord(4, 0, rollout_queue=queue_length(False, 3)), False, 3)  # synchronous: K does not matter
    check_queue(QueueRecord.from_host({"step": 4, "data_position": 0}), True, 2)  # saved before the key: not checked


def test_staleness_metrics_per_group_and_tokens_per_version():
    class Rollout:  # the fields staleness_metrics reads, for 2 groups of 2; the last response crossed a weight update
        token_versions = np.array([[3, 3, -1], [3, 3, -1], [1, -1, -1], [2, 3, 3]])
        response_mask = token_versions >= 0
        weight_versions = np.array([3, 3, 1, 2])  # each response's oldest token
        group_size = 2

    got = staleness_metrics(3, Rollout(), 2)  # type: ignore[arg-type]
    assert got == {"staleness_min": 0, "staleness_mean": 1.0, "staleness_max": 2, "groups_at_staleness/0": 0.5,
                   "groups_at_staleness/1": 0.0, "groups_at_staleness/2": 0.5, "tokens_at_staleness/0": 0.75,
                   "tokens_at_staleness/1": 0.125, "tokens_at_staleness/2": 0.125, "responses_crossing_update": 0.25}


def test_the_producers_idle_time_is_the_time_it_had_no_round():
    with Prefetcher() as prefetcher:
        start = time.perf_counter()
        concurrent.futures.wait([prefetcher.submit(time.sleep, 0.2)])
        time.sleep(0.2)
        stop = time.perf_counter()
        assert prefetcher.idle_seconds(start, stop) == pytest.approx(stop - start - 0.2, abs=0.05)


# ---------------------------------------------------------------------------------------------
# End to end: versions per step, and an exact resume
# ---------------------------------------------------------------------------------------------


def _rows(output_dir) -> tuple[list[dict], list[dict]]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r], [r for r in rows if "loss" not in r]


def _reproducible(row: dict) -> dict:
    """A metrics row without what the machine measures: timings and the process's memory high-water mark."""
    return {k: v for k, v in row.items() if "seconds" not in k and "per_second" not in k and k != "peak_rss_gb"}


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"drgrpo_weights_{pid}_")]


def _final_weights(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny_model, prompts_file):
    root = tmp_path_factory.mktemp("async")
    overrides = trainer_overrides(tiny_model, prompts_file, root / "uninterrupted", steps=4) + ASYNC
    process = start_trainer(overrides)
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    return {"root": root, "dir": root / "uninterrupted", "pid": process.pid, "model": tiny_model,
            "prompts": prompts_file}


@pytest.mark.subprocess  # the trainer CLI and its generation service
@pytest.mark.slow  # one trainer run (~1-2 minutes on 2 busy cores)
def test_each_step_trains_on_the_previous_version_and_the_child_takes_pushes_from_memory(async_run):
    rows, eval_rows = _rows(async_run["dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step k (1-based) trains version k-1's policy on a rollout of version k-2 (the first on version 0).
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(np.isfinite(r["tis_weight"]) and r["rollout_wait_seconds"] >= 0 for r in rows)
    assert [r["step"] for r in eval_rows] == [0, 2, 4]
    assert sorted(os.listdir(async_run["dir"] / "weights")) == ["v0"]  # versions 1.. went through shared memory
    if os.path.isdir("/dev/shm"):
        assert _segments_of(async_run["pid"]) == []


@pytest.mark.subprocess
@pytest.mark.slow  # a trainer run killed after its first checkpoint, then resumed (~2-3 minutes)
def test_a_killed_async_run_resumes_exactly(async_run):
    output_dir = async_run["root"] / "killed"
    overrides = trainer_overrides(async_run["model"], async_run["prompts"], output_dir, steps=4) + ASYNC
    killed, resumed = kill_and_resume(overrides, output_dir, checkpoint=2, timeout=900)
    for got, want in zip(_rows(output_dir), _rows(async_run["dir"])):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    got, want = _final_weights(output_dir / "final"), _final_weights(async_run["dir"] / "final")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    if os.path.isdir("/dev/shm"):  # the killed run's last segment was removed by the resumed one
        assert _segments_of(killed) == [] and _segments_of(resumed) == []


@pytest.mark.subprocess
@pytest.mark.slow  # a trainer start-up (~20 s), after the module's async run
def test_resuming_with_another_max_staleness_fails_in_one_line_and_keeps_the_checkpoints(async_run, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(async_run["dir"], output_dir)
    overrides = trainer_overrides(async_run["model"], async_run["prompts"], output_dir, steps=6) + ASYNC
    process = start_trainer([*overrides, "rollout.max_staleness=2"])
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 2, stderr[-3000:]
    assert "rollout.max_staleness: the checkpoint at step 4 was saved with rollout.async=true with " \
           "max_staleness=1" in stderr
    assert sorted(os.listdir(output_dir / "checkpoints")) == sorted(os.listdir(async_run["dir"] / "checkpoints"))


# ---------------------------------------------------------------------------------------------
# K = 2 with dynamic sampling: the queue end to end, and resumes after kills at two checkpoints
# ---------------------------------------------------------------------------------------------

TWO_AHEAD = ["rollout.async=true", "rollout.max_staleness=2", "algorithm.tis_cap=2.0",
             "rollout.dynamic_sampling=true", "rollout.max_resample_rounds=1"]


def _kill_at(overrides: list[str], output_dir, checkpoint: int) -> None:
    """Runs (or resumes) the trainer and SIGKILLs it once checkpoint `checkpoint` exists."""
    process = start_trainer(overrides)
    while not (output_dir / "checkpoints" / str(checkpoint)).exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"


@pytest.fixture(scope="module")
def two_ahead_run(tmp_path_factory, tiny_model, prompts_file):
    root = tmp_path_factory.mktemp("two_ahead")
    process = start_trainer(trainer_overrides(tiny_model, prompts_file, root / "uninterrupted", steps=6) + TWO_AHEAD)
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    return {"root": root, "dir": root / "uninterrupted", "model": tiny_model, "prompts": prompts_file}


@pytest.mark.subprocess
@pytest.mark.slow  # one trainer run (~1-2 minutes on 2 busy cores)
def test_with_k_2_each_step_trains_on_a_round_two_versions_back_and_logs_the_queue(two_ahead_run):
    rows, _ = _rows(two_ahead_run["dir"])
    # Step k (1-based) trains version k-1 on a first round of version max(0, k-3); the extra rounds are sampled
    # at the step, by its own version.
    assert [r["weight_version"] for r in rows] == [0, 0, 0, 1, 2, 3]
    assert [r["staleness_max"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert all(r["staleness_min"] <= r["staleness_mean"] <= r["staleness_max"] for r in rows)
    assert [r["queue_depth"] for r in rows] == [2, 2, 2, 2, 1, 0]  # the rounds of the next two steps, to the end
    for r in rows:
        mix = [r[f"tokens_at_staleness/{k}"] for k in range(3)]
        assert sum(mix) == pytest.approx(1.0) and r["sampling_rounds"] == 2
        assert r["producer_idle_seconds"] >= 0 and r["consumer_idle_seconds"] >= 0


@pytest.mark.subprocess
@pytest.mark.slow  # a trainer run killed after checkpoints 2 and 4, resumed each time (~3-4 minutes)
def test_a_k_2_run_killed_twice_resumes_exactly(two_ahead_run):
    output_dir = two_ahead_run["root"] / "killed"
    overrides = trainer_overrides(two_ahead_run["model"], two_ahead_run["prompts"], output_dir, steps=6) + TWO_AHEAD
    _kill_at(overrides, output_dir, checkpoint=2)
    kill_and_resume(overrides, output_dir, checkpoint=4, timeout=900)  # resumes from 2, killed after 4, resumed
    for got, want in zip(_rows(output_dir), _rows(two_ahead_run["dir"])):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    got, want = _final_weights(output_dir / "final"), _final_weights(two_ahead_run["dir"] / "final")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.subprocess
@pytest.mark.slow  # one more trainer run, its service killed with rounds queued (~1-2 minutes)
def test_a_k_2_run_whose_service_is_killed_with_rounds_queued_trains_on_the_same_groups(two_ahead_run):
    """SIGKILL the trainer's child service once step 2 is logged (the rounds of steps 3 and 4 queued, one maybe
    sampling): the client restarts it on the last pushed version and redoes the request with its seeds, so no
    group is lost or changed."""
    output_dir = two_ahead_run["root"] / "service_killed"
    overrides = trainer_overrides(two_ahead_run["model"], two_ahead_run["prompts"], output_dir, steps=6) + TWO_AHEAD
    process = start_trainer(overrides)
    metrics = output_dir / "metrics.jsonl"
    while process.poll() is None and not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
        time.sleep(0.05)
    services = services_of(process.pid)
    assert len(services) == 1, "the run ended before its service could be killed"
    os.kill(services[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    assert "restarting it on weight version" in stderr
    (rows, eval_rows), (want, want_eval) = _rows(output_dir), _rows(two_ahead_run["dir"])
    assert [r["service_restarts"] for r in rows][:2] == [0, 0] and rows[-1]["service_restarts"] == 1

    def trained(row: dict) -> dict:
        return {k: v for k, v in _reproducible(row).items() if k != "service_restarts"}

    assert [trained(r) for r in rows] == [trained(r) for r in want]
    assert [trained(r) for r in eval_rows] == [trained(r) for r in want_eval]
    got, final = _final_weights(output_dir / "final"), _final_weights(two_ahead_run["dir"] / "final")
    for name in final:
        np.testing.assert_array_equal(got[name], final[name], err_msg=name)
    if os.path.isdir("/dev/shm"):  # the segment the restarted child reloaded was removed at the end too
        assert _segments_of(process.pid) == []


@pytest.mark.subprocess
@pytest.mark.slow  # a trainer run up to its fourth step (~1 minute)
def test_a_queued_round_that_fails_stops_the_run_in_one_line(tmp_path, tiny_model, prompts_file):
    """K = 2: a reward turns NaN once step 1 is logged, in a round the producer thread scores ahead of its step:
    the step that takes it raises the RewardError (on every host: `collect.sample`'s fail_together), nothing
    hangs, and the run's service is stopped."""
    flag = tmp_path / "fail"
    overrides = trainer_overrides(tiny_model, prompts_file, tmp_path / "run", steps=4) + [
        "rollout.async=true", "rollout.max_staleness=2", "algorithm.tis_cap=2.0", "train.eval_every=0",
        "reward.functions=[support.reward_functions:nan_once_flagged]"]
    process = start_trainer(overrides, FAIL_REWARD_FILE=str(flag))
    metrics = tmp_path / "run" / "metrics.jsonl"
    while process.poll() is None and not (metrics.exists() and metrics.read_text().count('"loss"') >= 1):
        time.sleep(0.05)
    flag.touch()
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the run hung after a queued round failed")
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert process.returncode == 1 and last.startswith("python -m drgrpo_jax.train: RewardError: "), stderr[-3000:]
    assert 1 <= metrics.read_text().count('"loss"') < 4
    assert services_of(process.pid) == []


@pytest.mark.subprocess
@pytest.mark.slow  # two trainer runs, one killed after checkpoint 2 and resumed (~3-4 minutes)
def test_a_k_3_run_with_deferred_pushes_and_no_extra_rounds_resumes_exactly(tmp_path, tiny_model, prompts_file):
    """Without dynamic sampling nothing waits for a deferred push: the update overlaps it."""
    extra = ["rollout.async=true", "rollout.max_staleness=3", "algorithm.tis_cap=2.0"]
    whole = start_trainer(trainer_overrides(tiny_model, prompts_file, tmp_path / "whole", steps=5) + extra)
    _, stderr = whole.communicate(timeout=900)
    assert whole.returncode == 0, stderr[-3000:]
    rows, _ = _rows(tmp_path / "whole")
    assert [r["weight_version"] for r in rows] == [0, 0, 0, 0, 1]
    assert all(r["rollout_wait_seconds"] < 0.5 for r in rows)  # the update loop does not wait to push
    kill_and_resume(trainer_overrides(tiny_model, prompts_file, tmp_path / "killed", steps=5) + extra,
                    tmp_path / "killed", checkpoint=2, timeout=900)
    for got, want in zip(_rows(tmp_path / "killed"), _rows(tmp_path / "whole")):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    got, want = _final_weights(tmp_path / "killed" / "final"), _final_weights(tmp_path / "whole" / "final")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
