"""Issue #44: a batch already decoding stops at its next check (every --cancel-check-steps decode steps) once every
client of its rows is gone (disconnected, or answered at its deadline), and a row whose client left finishes there
without changing its batch-mates' tokens. In process, a real Scheduler on a tiny model with a long context: an
8,192-token row has 9 decode phases (`span_schedule`), so a batch that ran to its end would show here."""

import os
import threading
import time

import jax
import pytest
from fastapi.testclient import TestClient

from drgrpo_jax import host_memory
from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, bucket
from drgrpo_jax.sampler.generate import span_schedule
from drgrpo_jax.sampler.programs import compiled_programs
from drgrpo_jax.serve import scheduler as scheduler_module
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import RowResult, Scheduler

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.heavy  # each test compiles the sampler's programs for several phase shapes

LONG = SamplingParams(max_new_tokens=8192, temperature=1.0, ignore_eos=True)
LONG_PHASES = len(span_schedule(bucket(2), LONG.max_new_tokens))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("cancel") / "model"), seed=0, vocab_size=64,
                            max_position_embeddings=16384)


def _wait_for(condition, what: str, timeout_s: float = 300.0) -> None:
    """Polls `condition` (the scheduler's worker runs on its own thread) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_batch_whose_client_left_ends_at_the_next_check_and_the_worker_goes_on(model):
    """The running batch asks every --cancel-check-steps decode steps, within a phase too: a client that leaves
    well into a long phase has its row stopped at the next question (main: at the end of the phase)."""
    assert LONG_PHASES == 9
    every = 16
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0, cancel_check_steps=every))
    results, real_run = [], scheduler.run_batch
    future = None

    def leaves_at_the_20th_question(weights, rows, unwanted):
        questions = []

        def asked() -> list[bool]:
            questions.append(1)
            if len(questions) == 20:
                future.cancel()  # what the handler does when its client disconnects
            return unwanted()

        results.append(real_run(weights, rows, unwanted=asked))
        return results[-1]

    scheduler.run_batch = leaves_at_the_20th_question
    try:
        future = scheduler.submit([RowRequest((5, 9), LONG, seed=1)])
        _wait_for(lambda: scheduler.batches_run == 1 and scheduler.queued_tokens == 0, "the batch to end")
        assert scheduler.batches_stopped == 1 and scheduler.rows_cut == 1 and scheduler.phase_checks == 20
        (cut,) = results[0]
        # Questions are at most 16 steps apart from step 1 on; the phase of slots 256-512 runs to step 497.
        steps = span_schedule(bucket(2), LONG.max_new_tokens)
        phase_ends = [1 + span - bucket(2) for span in steps]
        assert 241 < len(cut.output_ids) <= 1 + every * 19 < phase_ends[4] == 497, len(cut.output_ids)
        assert scheduler.phases_run == 5  # main: all 9 phases, 8,192 tokens
        # The worker serves the next request, in full.
        next_one = scheduler.submit([RowRequest((7, 3), SamplingParams(max_new_tokens=100, ignore_eos=True), seed=2)])
        (result,) = next_one.result(timeout=300)
        assert len(result.output_ids) == 100 and not result.aborted
        assert scheduler.batches_stopped == 1 and scheduler.rows_cut == 1
    finally:
        scheduler.close()


def test_a_request_past_its_deadline_mid_decode_is_answered_with_abort_and_its_batch_stops(model):
    """The batch is held at its second phase boundary until the answer is out, so the deadline always passes while
    it decodes (on a fast machine the whole budget would otherwise fit in the deadline)."""
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0, request_timeout_s=2.0))
    client = TestClient(build_app(scheduler, None), base_url="http://localhost", raise_server_exceptions=False)
    answered, real_run = threading.Event(), scheduler.run_batch

    def held_after_the_first_phase(weights, rows, unwanted):
        checks = []

        def held() -> list[bool]:
            checks.append(1)
            if len(checks) == 2:
                answered.wait(60)
            return unwanted()

        return real_run(weights, rows, unwanted=held)

    scheduler.run_batch = held_after_the_first_phase
    try:
        answer = client.post("/generate", json={"input_ids": [5, 9], "sampling_params": {
            "max_new_tokens": LONG.max_new_tokens, "ignore_eos": True, "sampling_seed": 1}})
        answered.set()
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort" and answer.json()["output_ids"] == []
        _wait_for(lambda: scheduler.batches_run == 1 and scheduler.queued_tokens == 0, "the batch to end")
        assert scheduler.batches_stopped == 1 and scheduler.rows_cut == 1
        assert scheduler.phases_run <= 1  # 1 unless the prefill alone outlasted the deadline; main: all 9
    finally:
        answered.set()
        scheduler.close()


def test_a_row_whose_client_left_ends_early_and_its_batch_mate_is_sampled_as_alone(model):
    """Two requests in one batch: the long one's client leaves, the other gets the tokens its seed gives alone."""
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=2000.0))
    # Long enough (7 phases) that the other client leaves while both rows run.
    stays = [RowRequest((7, 3), SamplingParams(max_new_tokens=2000, ignore_eos=True), seed=2)]
    try:
        leaves = scheduler.submit([RowRequest((5, 9), LONG, seed=1)])
        kept = scheduler.submit(stays)  # within batch_wait_ms: one batch of 2 rows
        _wait_for(lambda: scheduler.phase_checks >= 1, "the batch to start decoding")
        leaves.cancel()
        (together,) = kept.result(timeout=300)
        _wait_for(lambda: scheduler.batches_run == 1 and scheduler.queued_tokens == 0, "the batch to end")
        assert scheduler.rows_cut == 1 and scheduler.batches_stopped == 0  # the batch went on for the other row
        (alone,) = scheduler.submit(stays).result(timeout=300)
        assert scheduler.batches_run == 2
        assert together.output_ids == alone.output_ids and len(alone.output_ids) == 2000
        assert together.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    finally:
        scheduler.close()


def test_an_idle_worker_hands_freed_memory_back(model, monkeypatch):
    """After its last queued batch the worker returns glibc's freed pages to the OS, so a burst of large requests
    does not leave the service's memory high once it is over (benchmarks/serve_burst.py measures the effect)."""
    from drgrpo_jax.serve import scheduler as scheduler_module

    trims = []
    monkeypatch.setattr(scheduler_module, "return_freed_memory", lambda: trims.append(1))
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0))
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        scheduler.submit([RowRequest((5, 9), params, seed=1)]).result(timeout=300)
        _wait_for(lambda: trims, "the idle worker to trim")
    finally:
        scheduler.close()


def test_a_worker_whose_queued_rows_were_all_abandoned_goes_idle(model, monkeypatch):
    """A worker that finds only abandoned rows at its batch boundary waits for work like one that ran out of it:
    it sheds memory then (before, it waited without, and a burst whose clients all left stayed in memory)."""
    from drgrpo_jax.serve import scheduler as scheduler_module

    trims = []
    monkeypatch.setattr(scheduler_module, "return_freed_memory", lambda: trims.append(1))
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0))
    try:
        running = scheduler.submit([RowRequest((5, 9), SamplingParams(max_new_tokens=2000, ignore_eos=True), seed=1)])
        _wait_for(lambda: scheduler.phase_checks >= 1, "the first batch to start decoding")
        scheduler.submit([RowRequest((7, 3), SamplingParams(max_new_tokens=4), seed=2)]).cancel()  # queued behind
        running.result(timeout=300)
        _wait_for(lambda: scheduler.rows_dropped == 1 and trims, "the worker to drop the row and go idle", 60)
    finally:
        scheduler.close()


def test_an_idle_service_over_its_program_cap_drops_them_and_answers_the_same_after(model, monkeypatch):
    """--max-kept-programs: each new batch shape compiles programs the service keeps (the memory a burst of new
    shapes leaves behind); once idle with more than the cap, it drops them all, and a shape that returns compiles
    again and samples the same tokens. 0 (the default) keeps every one."""
    monkeypatch.setattr(scheduler_module, "mapped_fraction", lambda: 0.0)  # far from the mapping limit
    row = [RowRequest((5, 9), SamplingParams(max_new_tokens=40, ignore_eos=True), seed=3)]
    keeps = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0))
    try:
        (kept,) = keeps.submit(row).result(timeout=300)
        assert compiled_programs() >= 2 and keeps.programs_dropped == 0  # a prefill and a decode phase
    finally:
        keeps.close()
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0, max_kept_programs=1))
    try:
        (first,) = scheduler.submit(row).result(timeout=300)
        _wait_for(lambda: scheduler.programs_dropped >= 2, "the idle service to drop its programs")
        assert compiled_programs() == 0
        (again,) = scheduler.submit(row).result(timeout=300)
        assert first.output_ids == again.output_ids == kept.output_ids
        assert again.logprobs == pytest.approx(first.logprobs, abs=1e-6)
    finally:
        scheduler.close()
    with pytest.raises(ValueError, match="max_kept_programs: must be >= 0"):
        ServeConfig(model=model, max_kept_programs=-1)


def test_compiled_programs_are_never_dropped_while_a_batch_runs_or_starts(model, monkeypatch):
    """The idle drop of every compiled program and the lanes' batches exclude each other: a lane going idle while
    the other lane's batch runs drops nothing, and a batch that arrives during a drop waits for its end. Main
    checked the other lane without a lock, so a short request's batch started in the middle of the drop."""
    monkeypatch.setattr(scheduler_module, "mapped_fraction", lambda: 0.6)  # every idle moment is a drop
    dropping, drop_may_end, long_may_end = threading.Event(), threading.Event(), threading.Event()
    real_clear = jax.clear_caches

    def held_clear() -> None:
        dropping.set()
        drop_may_end.wait(60)
        real_clear()

    monkeypatch.setattr(jax, "clear_caches", held_clear)
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=8, batch_wait_ms=1.0))
    started: list[int] = []

    def stand_in(weights, rows, unwanted=None):  # no program runs: the test is about when batches start
        started.append(rows[0].params.max_new_tokens)
        if rows[0].params.max_new_tokens > 8:
            long_may_end.wait(60)
        return [RowResult([], [], False, weights.version) for _ in rows]

    scheduler.run_batch = stand_in  # type: ignore[method-assign]
    try:
        long = scheduler.submit([RowRequest((5, 9), SamplingParams(max_new_tokens=64), seed=1)])
        _wait_for(lambda: started == [64], "the long batch to start")
        scheduler.submit([RowRequest((5, 9), SamplingParams(max_new_tokens=2), seed=2)]).result(timeout=60)
        assert not dropping.wait(0.5)  # the short lane went idle while the long batch ran: nothing dropped
        long_may_end.set()
        long.result(timeout=60)
        assert dropping.wait(60)  # both lanes idle: the drop starts, and is held
        short = scheduler.submit([RowRequest((7, 3), SamplingParams(max_new_tokens=2), seed=3)])
        time.sleep(1.0)
        assert started == [64, 2] and not short.done()  # the batch waits for the drop to end
        drop_may_end.set()
        short.result(timeout=60)
        assert started == [64, 2, 2]
    finally:
        long_may_end.set()
        drop_may_end.set()
        scheduler.close()


@pytest.mark.skipif(not os.path.exists("/proc/sys/vm/max_map_count"), reason="Linux's mapping limit only")
def test_compiled_programs_hold_memory_mappings_that_dropping_them_gives_back(model):
    """What the service's second reason to drop its programs rests on: XLA's CPU backend maps each compiled
    kernel on its own, so compiling sampler programs raises the process's share of vm.max_map_count and
    jax.clear_caches lowers it again."""
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())

    def regions() -> float:
        return host_memory.mapped_fraction() * limit

    jax.clear_caches()
    before = regions()
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0))
    try:
        scheduler.submit([RowRequest((5, 9), SamplingParams(max_new_tokens=40, ignore_eos=True), seed=3)]).result(300)
        compiled = regions()
        assert compiled > before + 100, (before, compiled)  # hundreds of regions: a set of programs' kernels
    finally:
        scheduler.close()
    jax.clear_caches()
    assert regions() < compiled - 100


def test_an_idle_service_near_the_mapping_limit_drops_its_programs_whatever_its_cap(model, monkeypatch):
    """Past half of vm.max_map_count a compile is a few bursts from a segfault: an idle service drops every
    compiled program even under the default --max-kept-programs 0, and answers the same after."""
    monkeypatch.setattr(scheduler_module, "mapped_fraction", lambda: 0.6)
    row = [RowRequest((5, 9), SamplingParams(max_new_tokens=40, ignore_eos=True), seed=3)]
    scheduler = Scheduler(ServeConfig(model=model, short_request_tokens=0, batch_wait_ms=1.0))
    try:
        (first,) = scheduler.submit(row).result(timeout=300)
        _wait_for(lambda: scheduler.programs_dropped >= 2, "the idle service to drop its programs")
        assert compiled_programs() == 0
        (again,) = scheduler.submit(row).result(timeout=300)
        assert first.output_ids == again.output_ids
    finally:
        scheduler.close()
