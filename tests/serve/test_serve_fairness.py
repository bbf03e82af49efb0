"""Issue #64 finding 11 and its open items, issue #63's streaming, in process on a tiny model: a request too large for
its share of the deadline is refused at admission (and no longer holds the queue from the small ones), an empty
answer says why, scoring holds the compiled programs as a sampling lane does, a weight swap between sampling and
scoring samples again instead of answering 503, and `stream: true` answers server-sent events."""

import concurrent.futures
import dataclasses
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.serve import openai_routes
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.heavy  # each test compiles the sampler's programs

SMALL = {"prompt": [5, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
OVERSIZE = {"prompt": [5, 9], "n": 8, "max_tokens": 2000, "ignore_eos": True}  # 8 x 2,002 = 16,016 queued tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("fair") / "model"), seed=0, vocab_size=64,
                            max_position_embeddings=4096)


def _client(scheduler: Scheduler) -> TestClient:
    return TestClient(build_app(scheduler, None), base_url="http://localhost", raise_server_exceptions=False)


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_an_oversize_request_is_refused_and_the_small_ones_are_answered(model):
    """Finding 11: main admitted the oversize request into an empty queue, and every small one behind it got 429
    (the queue holds just the oversize one) until its deadline, when it came back empty."""
    scheduler = Scheduler(ServeConfig(model=model, request_timeout_s=4.0, admission_tokens_per_second=100.0,
                                max_queued_tokens=16020, short_request_tokens=0, batch_wait_ms=1.0))
    client = _client(scheduler)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            oversize = pool.submit(client.post, "/v1/completions", json=OVERSIZE)
            _wait_for(lambda: scheduler.queued_tokens > 0 or oversize.done(), "the oversize request's admission")
            small = [client.post("/v1/completions", json=SMALL) for _ in range(3)]
            refused = oversize.result()
        assert [s.status_code for s in small] == [200] * 3, [s.text for s in small]
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "up to 2000 new tokens a completion would hold a batch for about 20 s" in message, message
        assert "--admission-share 0.5 of --request-timeout-s 4" in message, message
    finally:
        scheduler.close()


def test_the_measured_speed_refuses_what_cannot_be_done_in_its_share(model):
    """Without --admission-tokens-per-second the fastest batch that compiled nothing sets the speed; before one,
    nothing is refused."""
    scheduler = Scheduler(ServeConfig(model=model, request_timeout_s=1.0, short_request_tokens=0))
    client = _client(scheduler)
    try:
        assert scheduler.batch_seconds(4000) is None
        for _ in range(3):  # the first compiles; the next ones are measured
            assert client.post("/v1/completions", json=SMALL).status_code == 200
        assert scheduler.fastest_row_rate > 0
        answer = client.post("/v1/completions", json={**SMALL, "max_tokens": 4000})
        assert answer.status_code == 400 and "--request-timeout-s 1" in answer.text, answer.text
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    finally:
        scheduler.close()


def test_a_request_of_many_batches_takes_turns_with_a_later_one(model):
    """Rows of the least served request go first: a one-row request that arrives while the first of a six-row
    request's three batches runs is sampled in the next batch. Main sampled it after all three."""
    scheduler = Scheduler(ServeConfig(model=model, max_batch_size=2, short_request_tokens=0, batch_wait_ms=1.0))
    arrived, real_run, batches = threading.Event(), scheduler.run_batch, []

    def first_held(weights, rows, **kwargs):
        batches.append([row.seed for row in rows])
        if len(batches) == 1:
            arrived.wait(60)
        return real_run(weights, rows, **kwargs)

    scheduler.run_batch = first_held
    params = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)
    try:
        many = scheduler.submit([RowRequest((5, 9), params, seed, 0, 0) for seed in range(6)])
        _wait_for(lambda: batches, "the first batch")
        one = scheduler.submit([RowRequest((7, 3), params, 100, 0, 0)])
        arrived.set()
        one.result(timeout=120)
        assert not many.done() and 100 in batches[1], batches  # main: [[0, 1], [2, 3], [4, 5], [100]]
        assert len(many.result(timeout=120)) == 6
    finally:
        arrived.set()
        scheduler.close()


def test_a_completion_cut_by_its_deadline_says_why(model):
    """An empty 200 names the deadline (`abort_reason`; /generate's finish_reason.message), not just `abort`."""
    scheduler = Scheduler(ServeConfig(model=model, request_timeout_s=1.0))
    release, real_run = threading.Event(), scheduler.run_batch

    def held(weights, rows, **kwargs):
        release.wait(30)
        return real_run(weights, rows, **kwargs)

    scheduler.run_batch = held
    try:
        client = _client(scheduler)
        chat = client.post("/v1/completions", json={"prompt": [5, 9], "max_tokens": 4})
        native = client.post("/generate", json={"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 4}})
        choice = chat.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["token_ids"] == []
        assert choice["abort_reason"] == ("the request's deadline (--request-timeout-s 1) passed before this "
                                          "completion was sampled")
        assert native.json()["meta_info"]["finish_reason"]["message"] == choice["abort_reason"]
    finally:
        release.set()
        scheduler.close()


def test_scoring_holds_the_compiled_programs_like_a_lane(model, monkeypatch):
    """A lane that goes idle while a log-prob call runs must not drop the programs under it: main's scoring was not
    marked busy, and a /generate finishing meanwhile dropped every program mid-scoring."""
    scheduler = Scheduler(ServeConfig(model=model, max_kept_programs=1, short_request_tokens=0, batch_wait_ms=1.0))
    client = _client(scheduler)
    scoring_started, generated, seen = threading.Event(), threading.Event(), []
    real_score = openai_routes.score_sequences

    def held_score(*args, **kwargs):
        scoring_started.set()
        before = scheduler.programs_dropped
        generated.wait(120)
        time.sleep(0.5)  # the lane's idle check runs after its answer
        seen.append(scheduler.programs_dropped - before)
        return real_score(*args, **kwargs)

    monkeypatch.setattr(openai_routes, "score_sequences", held_score)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            scored = pool.submit(client.post, "/v1/completions", json={**SMALL, "logprobs": 1})
            assert scoring_started.wait(120)
            answer = client.post("/generate", json={"input_ids": [7, 3], "sampling_params": {"max_new_tokens": 3}})
            assert answer.status_code == 200, answer.text
            generated.set()
            assert scored.result().status_code == 200
        assert seen == [0], seen  # main: [the programs the idle lane dropped]
        _wait_for(lambda: scheduler.programs_dropped > 0, "the drop after the scoring")
    finally:
        generated.set()
        scheduler.close()


def _swap_after_sampling(scheduler: Scheduler, monkeypatch, swaps: int) -> list[int]:
    """Each of the first `swaps` samplings is followed by a new weight version (the same arrays)."""
    real_run_rows, calls = openai_routes.run_rows, []

    async def run_then_swap(*args, **kwargs):
        results = await real_run_rows(*args, **kwargs)
        calls.append(1)
        if len(calls) <= swaps:
            scheduler.served.current = dataclasses.replace(scheduler.weights, version=str(10 + len(calls)))
        return results

    monkeypatch.setattr(openai_routes, "run_rows", run_then_swap)
    return calls


def test_a_swap_between_sampling_and_scoring_samples_again_on_the_new_weights(model, monkeypatch):
    """Main answered 503 whenever a weight update landed between a request's sampling and its scoring (every
    push of a trainer, under --inflight-updates)."""
    scheduler = Scheduler(ServeConfig(model=model))
    calls = _swap_after_sampling(scheduler, monkeypatch, swaps=1)
    try:
        answer = _client(scheduler).post("/v1/completions", json={**SMALL, "logprobs": 1})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["weight_version"] == "11" and len(choice["logprobs"]["token_logprobs"]) == 8
        assert len(calls) == 2
    finally:
        scheduler.close()


def test_a_second_swap_answers_503(model, monkeypatch):
    scheduler = Scheduler(ServeConfig(model=model))
    _swap_after_sampling(scheduler, monkeypatch, swaps=2)
    try:
        answer = _client(scheduler).post("/v1/completions", json={**SMALL, "logprobs": 1})
        assert answer.status_code == 503 and "twice" in answer.json()["error"]["message"], answer.text
    finally:
        scheduler.close()


def _events(answer) -> list:
    """The `data:` payloads of a server-sent event stream, [DONE] as the string."""
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text.endswith("data: [DONE]\n\n")
    return [line[len("data: "):] if line.endswith("[DONE]") else json.loads(line[len("data: "):])
            for line in answer.text.split("\n\n") if line]


def test_stream_answers_server_sent_events_with_what_the_json_answer_holds(model):
    scheduler = Scheduler(ServeConfig(model=model))
    client = _client(scheduler)
    body = {"prompt": [[5, 9], [7, 3]], "max_tokens": 6, "temperature": 0, "logprobs": 1, "seed": 3}
    try:
        whole = client.post("/v1/completions", json=body).json()
        events = _events(client.post("/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}))
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        for expected in whole["choices"]:
            mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == expected["index"]]
            assert "".join(m["text"] for m in mine) == expected["text"]
            assert [m["finish_reason"] for m in mine] == [None, expected["finish_reason"]]
            assert mine[0]["logprobs"] == expected["logprobs"] and mine[0]["token_ids"] == expected["token_ids"]
        plain = _events(client.post("/v1/completions", json={**body, "stream": True}))
        assert all("usage" not in c for c in plain[:-1]) and len(plain) == 2 * 2 + 1
    finally:
        scheduler.close()
