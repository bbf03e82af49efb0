"""Issue 64 (findings 6, 7, 10): a client that trusts no engine. Each hostile answer a probe sent (impossible token
ids, duplicate or mixed choice indexes, a string choice, HTML or broken JSON with status 200, JSON nested 100k deep,
an answer past its size, a server that trickles a byte a second) fails as one RolloutError line naming the server
and the field, for our wire, SGLang's and vLLM's alike."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest

from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rollout import client as client_module
from drgrpo_jax.rollout.client import RolloutClient

VOCAB = 50257
VLLM_ROUTES = {"paths": {"/inference/v1/generate": {}, "/collective_rpc": {}, "/update_weight_version": {},
                         "/server_info": {}}}
VLLM_INFO = {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}
ROUTE = {"ours": "/generate", "sglang": "/generate", "vllm": "/inference/v1/generate"}


def sglang_items(ids_per_row: list[list]) -> list[dict]:
    """SGLang /generate items with one matching log-prob per id."""
    return [{"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                              "finish_reason": {"type": "length"}, "weight_version": "0"}}
            for ids in ids_per_row]


def vllm_answer(ids_per_choice: list[list], indexes: list | None = None) -> dict:
    """A vLLM /inference/v1/generate answer with one matching log-prob entry per id."""
    indexes = list(range(len(ids_per_choice))) if indexes is None else indexes
    return {"choices": [{"index": index, "token_ids": ids, "finish_reason": "length",
                         "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]}}
                        for index, ids in zip(indexes, ids_per_choice)]}


def fake(engine: str, answer: httpx.Response, model_info: dict | None = None):
    """A server of `engine` that reports its start-up settings and answers every generate call with `answer`."""

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/openapi.json":
            return httpx.Response(200, json=VLLM_ROUTES)
        if path == "/server_info":
            return httpx.Response(200, json=VLLM_INFO if engine == "vllm" else {"enable_deterministic_inference": 1})
        if path == "/get_model_info" and model_info is not None:
            return httpx.Response(200, json=model_info)
        if path == ROUTE[engine]:
            return answer
        return httpx.Response(404, json={"detail": "Not Found"})
    return handler


def generate(engine: str, answer: httpx.Response, group_size: int = 2, **kwargs):
    """One generate call of one prompt x `group_size` against a fake `engine` answering `answer`."""
    kwargs.setdefault("vocab_size", VOCAB)
    with RolloutClient(["http://h:1"], transport=httpx.MockTransport(fake(engine, answer, kwargs.pop("info", None))),
                       backoff_s=0.0, engine=engine, **kwargs) as client:
        return client.generate([[1, 2, 3]], group_size, max_new_tokens=4, seed=0)


def refusal(engine: str, answer: httpx.Response, **kwargs) -> str:
    """The one line a hostile answer fails with; it names the server and its route."""
    with pytest.raises(RolloutError) as error:
        generate(engine, answer, **kwargs)
    line = str(error.value)
    assert "\n" not in line and line.startswith(f"http://h:1{ROUTE[engine]}: "), line
    return line


IMPOSSIBLE_IDS = [
    ([-5, -1, 3], "token id -5 is outside the vocabulary (50257)"),
    ([1000000, 2147483647], "token id 1000000 is outside the vocabulary (50257)"),
    ([5.0, 6.0], "5.0 is not a token id (an integer)"),
    ([True], "True is not a token id (an integer)"),
    ([2**40], "token id 1099511627776 is outside the vocabulary (50257)"),
]


@pytest.mark.parametrize("ids, reason", IMPOSSIBLE_IDS)
def test_vllm_ids_outside_the_vocabulary_or_not_integers_are_refused(ids, reason):
    line = refusal("vllm", httpx.Response(200, json=vllm_answer([[7], ids])))
    assert line.endswith(f"choices[1].token_ids[0]: {reason}"), line


@pytest.mark.parametrize("engine", ["ours", "sglang"])
@pytest.mark.parametrize("ids, reason", IMPOSSIBLE_IDS)
def test_sglang_wire_ids_outside_the_vocabulary_or_not_integers_are_refused(engine, ids, reason):
    line = refusal(engine, httpx.Response(200, json=sglang_items([[7], ids])))
    assert line.endswith(f"[1].output_ids[0]: {reason}"), line


def test_a_log_prob_entry_for_another_token_is_refused_by_its_field():
    answer = sglang_items([[7], [8]])
    answer[1]["meta_info"]["output_token_logprobs"][0][1] = 1000000
    line = refusal("ours", httpx.Response(200, json=answer))
    assert line.endswith("[1].meta_info.output_token_logprobs[0]: token id 1000000 is outside the vocabulary "
                         "(50257)"), line


def test_our_service_reports_its_vocabulary_once_and_the_trainers_needs_no_request():
    asked = []

    def counting(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return fake("ours", httpx.Response(200, json=sglang_items([[7], [99]])), {"vocab_size": 64})(request)

    with RolloutClient(["http://h:1"], transport=httpx.MockTransport(counting), backoff_s=0.0) as client:
        with pytest.raises(RolloutError, match=r"^http://h:1/generate: \[1\]\.output_ids\[0\]: token id 99 is "
                                               r"outside the vocabulary \(64\)$"):
            client.generate([[1, 2, 3]], 2, max_new_tokens=4, seed=0)
        with pytest.raises(RolloutError):
            client.generate([[1, 2, 3]], 2, max_new_tokens=4, seed=0)
    assert asked.count("/get_model_info") == 1
    asked.clear()
    with RolloutClient(["http://h:1"], transport=httpx.MockTransport(counting), backoff_s=0.0,
                       vocab_size=128) as client:
        assert client.generate([[1, 2, 3]], 2, max_new_tokens=4, seed=0).response_ids[1, 0] == 99
    assert "/get_model_info" not in asked


@pytest.mark.parametrize("indexes, reason", [
    ([0, 0], "choices[1].index: 0 again (one choice per index)"),
    ([0, 2], "choices[1].index: 2 is not an integer in [0, 2)"),
    ([0, "1"], "choices[1].index: '1' is not an integer in [0, 2)"),
    ([0, True], "choices[1].index: True is not an integer in [0, 2)"),
    ([0, None], "choices[1].index: None is not an integer in [0, 2)"),
])
def test_vllm_choices_are_one_per_index(indexes, reason):
    line = refusal("vllm", httpx.Response(200, json=vllm_answer([[7], [8]], indexes)))
    assert line.endswith(reason), line


def test_a_string_choice_is_refused():
    answer = vllm_answer([[7], [8]])
    answer["choices"][0] = "x"
    assert refusal("vllm", httpx.Response(200, json=answer)).endswith("choices[0]: 'x', not an object")


@pytest.mark.parametrize("engine", ["ours", "sglang", "vllm"])
@pytest.mark.parametrize("content, content_type, reason", [
    (b"<html><body>Sign in</body></html>", "text/html", "the answer is not JSON (text/html, 33 bytes)"),
    (b'{"choices": [', "application/json", "the answer is not JSON (application/json, 13 bytes)"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "the answer is JSON nested deeper than the client reads"),
    (b"[" + b"9" * 5000 + b"]", "application/json", "the answer is not JSON (application/json, 5002 bytes)"),
])
def test_an_answer_that_is_no_json_is_refused_in_one_line(engine, content, content_type, reason):
    answer = httpx.Response(200, content=content, headers={"content-type": content_type})
    assert refusal(engine, answer).endswith(reason)


def test_an_answer_past_what_the_request_could_need_is_refused(monkeypatch):
    """The cap is the rows x budget x bytes per token (2 x 4 x 1,024 here, the floor lowered for the test)."""
    monkeypatch.setattr(client_module, "MIN_ANSWER_CAP", 1000)
    padded = sglang_items([[7], [8]])
    padded[0]["meta_info"]["padding"] = "x" * 9000
    assert refusal("ours", httpx.Response(200, json=padded)).endswith("the answer runs past 8192 bytes, more than "
                                                                      "the request could need")
    padded[0]["meta_info"]["padding"] = "x" * 7000
    assert generate("ours", httpx.Response(200, json=padded)).lengths.tolist() == [1, 1]


class Trickle(http.server.BaseHTTPRequestHandler):
    """Answers every POST with its headers at once, then a byte a second of a body it never finishes."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        try:
            for _ in range(30):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:  # the client hung up
            pass

    def log_message(self, *args) -> None:
        pass


def test_a_trickling_server_fails_at_the_deadline_not_per_read():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with RolloutClient([url], timeout_s=3.0, max_retries=0, vocab_size=VOCAB) as client:
            start = time.monotonic()
            with pytest.raises(RolloutError) as error:
                client.generate([[1, 2, 3]], 1, max_new_tokens=4, seed=0)
            elapsed = time.monotonic() - start
    finally:
        server.shutdown()
        server.server_close()
    assert elapsed < 3.0 + 1.5, elapsed
    line = str(error.value)
    assert "\n" not in line and f"{url}/generate: " in line and "within timeout_s=3 s" in line, line


@pytest.mark.parametrize("engine, route", [("sglang", "/update_weights_from_disk"), ("vllm", "/openapi.json")])
def test_a_start_up_or_push_answer_that_is_no_object_is_refused(engine, route):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=["x"]) if request.url.path == route else \
            fake(engine, httpx.Response(404))(request)

    with RolloutClient(["http://h:1"], transport=httpx.MockTransport(handler), backoff_s=0.0, engine=engine) as client:
        with pytest.raises(RolloutError) as error:
            client.update_weights("/weights/v1", 1)
    assert f"http://h:1{route}: the answer: a list, not an object" in str(error.value), str(error.value)
    assert "\n" not in str(error.value)
