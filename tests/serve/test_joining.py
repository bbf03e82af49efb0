"""Issue #65: continuous admission (--continuous-admission, serve/joining.py). A request that arrives while a long
batch runs joins it at its next boundary, samples what it samples alone, and is answered before the long batch
ends (checked by the order of events, not by time)."""

import threading

import pytest
from fastapi.testclient import TestClient

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.heavy  # a scheduler compiles the sampler's programs

LONG = RowRequest((5, 9, 11), SamplingParams(max_new_tokens=100, temperature=1.0, ignore_eos=True), seed=1)
SHORT = [RowRequest((7, 8, 9, 10), SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, ignore_eos=True),
                    seed=2, sample=k) for k in range(2)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("joining") / "model"), vocab_size=64)  # splits over tensor=2


@pytest.fixture(params=["", "tensor=2,data=2"])
def scheduler(folder, request):
    scheduler = Scheduler(ServeConfig(model=folder, mesh=request.param, short_request_tokens=0, batch_wait_ms=1.0,
                                      cancel_check_steps=4, continuous_admission=True, max_batch_size=4))
    yield scheduler
    scheduler.close()


def test_a_short_request_joins_a_running_batch_and_is_answered_first(scheduler):
    queued, questions, real = threading.Event(), [], scheduler.run_batch

    def held(weights, rows, unwanted=None, **joining):
        def asked() -> list[bool]:  # the long batch's second boundary waits until the short request is queued
            questions.append(1)
            if len(questions) == 2:
                assert queued.wait(60)
            return unwanted()

        return real(weights, rows, unwanted=asked, **joining)

    scheduler.run_batch = held  # type: ignore[method-assign]
    try:
        long = scheduler.submit([LONG])  # a batch of one row: it grows to take the short request's two
        while not questions:
            threading.Event().wait(0.01)
        short = scheduler.submit(SHORT)
        queued.set()
        joined = short.result(timeout=300)
        assert not long.done()  # the long row still had most of its 100 steps to run
        long_result = long.result(timeout=300)[0]
    finally:
        scheduler.run_batch = real  # type: ignore[method-assign]
    while scheduler.batches_run < 1:  # answered at the last boundary: the batch ends just after
        threading.Event().wait(0.01)
    assert scheduler.rows_joined == 2 and len(long_result.output_ids) == 100
    # Alone (each its own batch now), both sample what they sampled together.
    alone = scheduler.submit(SHORT).result(timeout=300)
    for together, by_itself in zip(joined, alone):
        assert together.output_ids == by_itself.output_ids and len(together.output_ids) == 8
        assert together.logprobs == pytest.approx(by_itself.logprobs, abs=1e-5)
    long_alone = scheduler.submit([LONG]).result(timeout=300)[0]
    assert long_result.output_ids == long_alone.output_ids
    assert long_result.logprobs == pytest.approx(long_alone.logprobs, abs=1e-5)
    info = TestClient(build_app(scheduler), base_url="http://localhost").get("/get_model_info").json()
    assert info["continuous_admission"] is True and info["rows_joined"] == 2
