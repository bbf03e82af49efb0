"""Log-prob scoring against a deadline: each call is sized by a measured scoring rate as well as by memory, and no
call predicted to end past the deadline is started (one call of every row, asked only between calls, used to run
tens of seconds past it)."""

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from flax import nnx

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.serve import openai_routes, scoring
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler

from support.tiny_models import SAMPLER_VOCAB, tiny_sampler_model, write_tiny_llama

LENGTHS = (10, 7, 12, 3, 9, 11, 5, 8)  # one bucket of 16 positions


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(tiny_sampler_model())


def _sequences(lengths=LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, SAMPLER_VOCAB, n).tolist() for n in lengths]


class FakeClock:
    """A clock that moves only when a scoring call runs: each call takes exactly `seconds_per_token` x its
    bucketed rows x positions, so the rate learnt is the rate given and every figure below is exact."""

    def __init__(self, seconds_per_token: float):
        self.now, self.seconds_per_token, self.calls = 0.0, seconds_per_token, []

    def __call__(self) -> float:
        return self.now

    def run(self, real_score_rows):
        def timed(graphdef, state, sequences, *args, **kwargs):
            self.calls.append(len(sequences))
            width, length = scoring.call_shape(len(sequences), max(map(len, sequences)))
            self.now += self.seconds_per_token * width * length
            return real_score_rows(graphdef, state, sequences, *args, **kwargs)
        return timed


@pytest.mark.parametrize(("lengths", "per_token", "left", "rows"), [
    ((10,) * 8, 0.001, None, 8),  # no deadline: the memory bound alone
    ((10,) * 8, 0.0, 100.0, 1),  # speed unknown: one row, whose time teaches it
    ((10,) * 8, 0.001, 0.0, 0),  # the deadline has passed
    ((10,) * 8, 0.001, 8 * 16 * 0.001, 8),  # exactly in time
    ((10,) * 8, 0.001, 8 * 16 * 0.001 - 1e-9, 4),  # just short: the row bucket below
    ((10,) * 6, 0.001, 7 * 16 * 0.001, 4),  # 6 rows run as 8 (the bucket), 7 rows' time: 4
    ((10, 10, 40), 0.001, 2 * 16 * 0.001, 2),  # the third row's 64 positions would make the call 4 x 64
    ((10,), 0.001, 15 * 0.001, 0),  # one row is predicted past the deadline: nothing runs
])
def test_rows_in_time_fit_the_time_left(lengths, per_token, left, rows):
    assert scoring.rows_in_time(lengths, per_token, left) == rows


def test_a_request_predicted_past_its_deadline_runs_no_call(split_model, monkeypatch):
    """One row of 16 positions at a second a position: 16 s, against 10 s left. Main scored it (and would have run
    on past the deadline)."""
    graphdef, state = split_model
    calls = []
    monkeypatch.setattr(scoring, "_score_rows", lambda graphdef, state, sequences, *a: calls.append(len(sequences)))
    scored = scoring.score_sequences(graphdef, state, _sequences()[:1], [1.0], 1, SAMPLER_VOCAB, deadline=10.0,
                                     rate=scoring.ScoringRate(1.0), clock=lambda: 0.0)
    assert scored is None and calls == []


def test_calls_are_sized_to_the_time_left_and_stop_before_the_deadline(split_model, monkeypatch):
    """A row of 16 positions takes 16 ms. 100 ms left: 8 rows (128 ms) do not fit, 4 (64 ms) do; then 36 ms
    left: 2 rows; then 4 ms: not even one row, so the scoring gives up before its deadline."""
    graphdef, state = split_model
    clock = FakeClock(0.001)
    monkeypatch.setattr(scoring, "_score_rows", clock.run(scoring._score_rows))
    rate = scoring.ScoringRate(0.001)
    scored = scoring.score_sequences(graphdef, state, _sequences(), [1.0] * 8, 1, SAMPLER_VOCAB, rows_per_call=8,
                                     deadline=0.1, rate=rate, clock=clock)
    assert scored is None and clock.calls == [4, 2], clock.calls  # main: one call of 8 rows (128 ms)
    assert clock.now <= 0.1 and rate.seconds_per_token == pytest.approx(0.001)


def test_the_rate_is_learnt_from_calls_that_compiled_nothing(split_model, monkeypatch):
    """Speed unknown: one row a call until a call that compiled nothing has taught the rate, then every row left
    in one call (the deadline is far)."""
    graphdef, state = split_model
    clock, traced = FakeClock(0.002), []
    timed = clock.run(scoring._score_rows)

    def noting_traces(*args, **kwargs):
        before = len(scoring._traced)
        out = timed(*args, **kwargs)
        traced.append(len(scoring._traced) > before)
        return out

    monkeypatch.setattr(scoring, "_score_rows", noting_traces)
    rate = scoring.ScoringRate()
    scored = scoring.score_sequences(graphdef, state, _sequences((6,) * 5), [1.0] * 5, 2, SAMPLER_VOCAB,
                                     rows_per_call=8, deadline=1e6, rate=rate, clock=clock)
    assert scored is not None and len(scored) == 5
    learnt = traced.index(False)  # the first call that compiled nothing
    assert clock.calls == [1] * (learnt + 1) + [5 - learnt - 1], (clock.calls, traced)
    assert rate.seconds_per_token == pytest.approx(0.002)


def test_results_equal_one_call_scoring(split_model):
    """A deadline cuts a request into calls of 1, 2, 4 ... rows (the row buckets): each row scores as in one call
    of every row (rows are independent, padding is masked), to float rounding: XLA's CPU matrix products round
    differently at another batch width (1.2e-5 here, the same for 4 + 4 rows as for 1 + 1 + 2 + 3 + 1)."""
    graphdef, state = split_model
    sequences, temperatures = _sequences(), [0.7, 0.0, 1.3, 1.0, 0.5, 1.0, 2.0, 0.9]
    whole = scoring.score_sequences(graphdef, state, sequences, temperatures, 3, SAMPLER_VOCAB, rows_per_call=8)
    cut = []
    for start, rows in ((0, 1), (1, 1), (2, 2), (4, 3), (7, 1)):
        cut += scoring.score_sequences(graphdef, state, sequences[start:start + rows],
                                       temperatures[start:start + rows], 3, SAMPLER_VOCAB, rows_per_call=rows)
    for mine, one_call in zip(cut, whole, strict=True):
        assert mine.top_ids == one_call.top_ids
        np.testing.assert_allclose(mine.token_logprobs, one_call.token_logprobs, rtol=0, atol=5e-5)
        np.testing.assert_allclose(mine.top_logprobs, one_call.top_logprobs, rtol=0, atol=5e-5)


ROW_SECONDS = 0.4  # what the slowed scoring program takes per row


@pytest.mark.heavy  # compiles the sampler's programs and four scoring programs
def test_an_over_deadline_scoring_request_frees_the_service_within_a_row(tmp_path, monkeypatch):
    """Eight prompts scored on a 2 s deadline, the scoring program slowed to 0.4 s a row. Main ran all eight rows
    in one 3.2 s call that went on 1.3 s past the deadline; here each call takes the rows predicted to end in time,
    and the scoring is over by the deadline (bounded by one row's call past it)."""
    model = write_tiny_llama(str(tmp_path / "model"), seed=0, vocab_size=64, max_position_embeddings=256)
    scheduler = Scheduler(ServeConfig(model=model, max_batch_size=8, request_timeout_s=2.0, short_request_tokens=0,
                                      batch_wait_ms=1.0))
    body = {"prompt": [[5, 9, i] + [7] * 20 for i in range(3, 11)], "max_tokens": 0, "echo": True}
    ended, real_score = [], scoring._score

    def slowed_score(graphdef, state, ids, *args, **kwargs):
        time.sleep(ROW_SECONDS * ids.shape[0])  # the call's bucketed rows: what its time is measured in
        return real_score(graphdef, state, ids, *args, **kwargs)

    def timed_score_sequences(*args, **kwargs):
        try:
            return scoring.score_sequences(*args, **kwargs)
        finally:
            ended.append(time.monotonic())

    try:
        client = TestClient(build_app(scheduler, None), base_url="http://localhost")
        for _ in range(20):  # until the sampler's programs are compiled: sampling then ends well within 2 s
            if client.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"] != "abort":
                break
        weights = scheduler.weights
        sequences = body["prompt"]
        for rows in (1, 2, 4, 8):  # every call shape the request can take, compiled before it is timed
            scoring.score_sequences(weights.graphdef, weights.state, sequences[:rows], [1.0] * rows, 1,
                                    weights.config.vocab_size, scheduler.config.max_scoring_bytes,
                                    rows_per_call=rows)
        monkeypatch.setattr(scoring, "_score", slowed_score)
        monkeypatch.setattr(openai_routes, "score_sequences", timed_score_sequences)
        sent = time.monotonic()
        answer = client.post("/v1/completions", json={**body, "logprobs": 1})
        assert answer.status_code == 200, answer.text
        assert {c["finish_reason"] for c in answer.json()["choices"]} == {"abort"}
        # (TestClient answers once the app's threads are done, so the scoring's end is timed from the request.)
        assert len(ended) == 1 and ended[0] - sent < 2.0 + ROW_SECONDS, ended[0] - sent  # main: 3.3 s
    finally:
        scheduler.close()
