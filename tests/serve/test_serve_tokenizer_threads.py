"""Concurrent text requests to the service (in process: FastAPI's TestClient over a real Scheduler on the tiny chat
model) while another thread calls the same tokenizer with its own truncation: every request is answered 200 with
the text it gets alone (issue #62: the service tokenizes and decodes on `asyncio.to_thread`'s threads)."""

import concurrent.futures
import sys
import threading

import pytest
from fastapi.testclient import TestClient

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.serve import served_tokenizer
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler

from support.chat_models import write_chat_model

TEXTS = ["what is 2+2?", "name a colour", "count to five", "say hello", "a word with z", "spell cat"] * 4
GREEDY = {"max_new_tokens": 3, "temperature": 0.0}
ROUTES = ("/generate", "/v1/chat/completions")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The app over the tiny chat model, its tokenizer loaded as the service's command line loads it."""
    config = ServeConfig(model=write_chat_model(str(tmp_path_factory.mktemp("chat") / "model")), max_batch_size=32,
                         batch_wait_ms=20.0)
    scheduler, tokenizer = Scheduler(config), served_tokenizer(config)
    try:
        with TestClient(build_app(scheduler, tokenizer), base_url="http://localhost") as client:
            yield client, tokenizer
    finally:
        scheduler.close()


def ask(client: TestClient, route: str) -> tuple[int, object]:
    """A batch of texts on /generate or a conversation on /v1/chat/completions: its status and what it answered
    that the tokenizer made (texts and prompt lengths)."""
    if route == "/generate":
        answer = client.post(route, json={"text": TEXTS, "sampling_params": GREEDY})
        return answer.status_code, [(a["text"], a["meta_info"]["prompt_tokens"]) for a in answer.json()]
    answer = client.post(route, json={"messages": [{"role": "user", "content": TEXTS[0]}], "max_tokens": 3,
                                      "temperature": 0.0})
    body = answer.json()
    return answer.status_code, (body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"])


def test_concurrent_text_requests_get_the_answers_they_get_alone(service):
    client, tokenizer = service
    alone = {route: ask(client, route) for route in ROUTES}
    assert [status for status, _ in alone.values()] == [200, 200]
    assert [tokens for _, tokens in alone["/generate"][1]] == [len(text) for text in TEXTS]  # a token a character
    done = threading.Event()

    def truncating():  # another user of the same tokenizer object, in this process
        while not done.is_set():
            tokenizer(TEXTS, truncation=True, max_length=2)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave within a few calls, not once per 5 ms
    try:
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            other = pool.submit(truncating)
            answers = list(pool.map(lambda route: ask(client, route), ROUTES * 8))
            done.set()
            other.result()
    finally:
        done.set()
        sys.setswitchinterval(before)
    assert answers == [alone[route] for route in ROUTES * 8]
