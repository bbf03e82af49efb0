"""The generation service as a real child process: SGLang-style API, OpenAI client, weight swaps, bad input."""

import concurrent.futures
import json
import os
import shutil
import time

import httpx
import numpy as np
import pytest

from drgrpo_jax.rollout.local_service import LocalServer

from support.tiny_models import write_tiny_llama

VOCAB = 64
EOS = 2
PEAKED = {"vocab_size": VOCAB, "initializer_range": 0.5, "max_position_embeddings": 256}  # seed-dependent outputs

pytestmark = pytest.mark.subprocess  # the service runs as a child process


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and its log-probs from transformers (PyTorch), stopping at EOS."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    if EOS in tokens:
        tokens = tokens[:tokens.index(EOS) + 1]
    logprobs = [torch.log_softmax(out.scores[t][0].float(), -1)[tok].item() for t, tok in enumerate(tokens)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two weight versions, a model of another shape and a corrupt copy."""
    root = tmp_path_factory.mktemp("serve")
    v0 = write_tiny_llama(str(root / "v0"), seed=0, **PEAKED)
    v1 = write_tiny_llama(str(root / "v1"), seed=1, **PEAKED)
    wider = write_tiny_llama(str(root / "wider"), seed=2, hidden_size=48, **PEAKED)
    corrupt = str(root / "corrupt")
    shutil.copytree(v1, corrupt)
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(corrupt, "model.safetensors")) // 2)
    return {"v0": v0, "v1": v1, "wider": wider, "corrupt": corrupt}


@pytest.fixture(scope="module")
def server(folders):
    """One service for the module; batch window wide enough that concurrent requests meet."""
    with LocalServer(folders["v0"], extra_args=["--max-batch-size", "8", "--batch-wait-ms", "100"]) as srv:
        yield srv


def generate(url: str, body, timeout: float = 300.0) -> httpx.Response:
    """POST /generate (a dict is sent as JSON, bytes as they are)."""
    if isinstance(body, bytes):
        return httpx.post(url + "/generate", content=body, headers={"content-type": "application/json"},
                          timeout=timeout)
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def greedy_body(prompt, max_new_tokens=12):
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "return_logprob": True}


PROMPT = [5, 9, 14, 3, 30]


def test_greedy_and_logprobs_match_transformers(server, folders):
    answer = generate(server.url, greedy_body(PROMPT)).json()
    tokens, logprobs = hf_greedy(folders["v0"], PROMPT, 12)
    assert answer["output_ids"] == tokens
    meta = answer["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
    np.testing.assert_allclose([lp for lp, _, _ in meta["output_token_logprobs"]], logprobs, atol=1e-4)
    stopped = tokens[-1] == EOS
    assert meta["finish_reason"]["type"] == ("stop" if stopped else "length")
    assert meta["weight_version"] == "0" and meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(tokens)


def test_batch_n_seed_and_text(server):
    body = {"input_ids": [PROMPT, [7, 8]], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "n": 3, "seed": 11}}
    first, again = generate(server.url, body).json(), generate(server.url, body).json()
    assert len(first) == 6 and [a["output_ids"] for a in first] == [a["output_ids"] for a in again]
    assert len({tuple(a["output_ids"]) for a in first}) == 6  # samples and prompts draw different streams
    for item in first:
        assert len(item["output_ids"]) <= 10 and len(item["meta_info"]["output_token_logprobs"]) == len(
            item["output_ids"])
    other = generate(server.url, {**body, "sampling_params": {**body["sampling_params"], "seed": 12}}).json()
    assert [a["output_ids"] for a in other] != [a["output_ids"] for a in first]
    text = generate(server.url, {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert text["meta_info"]["prompt_tokens"] == 5 and isinstance(text["text"], str)


def test_stop_token_ids_end_a_completion(server):
    tokens = generate(server.url, greedy_body(PROMPT)).json()["output_ids"]
    stop = tokens[3]
    body = greedy_body(PROMPT)
    body["sampling_params"]["stop_token_ids"] = [stop]
    answer = generate(server.url, body).json()
    assert answer["output_ids"] == tokens[:tokens.index(stop) + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_openai_client_completions(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].id
    out = client.completions.create(model="tiny", prompt="hi there", max_tokens=6, temperature=0.0, n=2,
                                    logprobs=1)
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text  # greedy: both the same
    assert out.choices[0].finish_reason in ("stop", "length")
    assert len(out.choices[0].logprobs.token_logprobs) == out.usage.completion_tokens // 2
    assert out.usage.prompt_tokens == len("hi there")  # counted once per prompt, as vLLM does
    by_ids = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0)
    native = generate(server.url, greedy_body(PROMPT)).json()
    assert by_ids.choices[0].model_extra["token_ids"] == native["output_ids"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)


def test_concurrent_requests_share_batches(server):
    before = httpx.get(server.url + "/get_model_info").json()["batches_run"]
    prompts = [[i + 3, i + 4] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: generate(server.url, greedy_body(p, 6)).json(), prompts))
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["batches_run"] - before < len(prompts)  # fewer batches than requests: they were batched together
    assert info["rows_cut"] == info["batches_stopped"] == 0  # every client waited for its answer
    assert info["compiled_programs"] >= 2  # a prefill and a decode phase at least
    for prompt, answer in zip(prompts, answers):  # and batching did not change any answer
        assert answer["output_ids"] == generate(server.url, greedy_body(prompt, 6)).json()["output_ids"]


@pytest.mark.parametrize("body,field", [
    (b"{not json", "body"),
    ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "n"),
    ({"input_ids": [1, 2], "sampling_params": {"temperatur": 1.0}}, "temperatur"),
    ({"input_ids": [1] * 250, "sampling_params": {"max_new_tokens": 10}}, "context"),
    ({"input_ids": [1, VOCAB]}, "vocabulary"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1], []]}, "empty prompt"),
    ({"input_ids": ["a", "b"]}, "input_ids"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "text": "a"}, "exactly one"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
    ([1, 2, 3], "body"),
])
def test_malformed_requests_get_400_and_the_service_survives(server, body, field):
    response = generate(server.url, body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_weight_updates_leave_the_old_weights_serving(server, folders, tmp_path):
    before = generate(server.url, greedy_body(PROMPT)).json()["output_ids"]
    version = httpx.get(server.url + "/get_weight_version").json()["weight_version"]
    no_config = tmp_path / "no_config"
    shutil.copytree(folders["v1"], no_config)
    os.remove(no_config / "config.json")
    # Load failures say only that the folder is not a model (no file-system detail); a model of another shape
    # says what differs from the served one.
    for path, reason in [(folders["corrupt"], "not a valid model folder"), (folders["wider"], "hidden_size"),
                         (str(tmp_path / "missing"), "not a valid model folder"),
                         (str(no_config), "not a valid model folder")]:
        response = httpx.post(server.url + "/update_weights_from_disk",
                              json={"model_path": path, "weight_version": "99"}, timeout=120)
        assert response.status_code == 400 and response.json()["success"] is False
        assert reason in response.json()["message"]
        assert httpx.get(server.url + "/get_weight_version").json()["weight_version"] == version
        assert generate(server.url, greedy_body(PROMPT)).json()["output_ids"] == before


def test_weight_update_mid_stream_changes_version_and_outputs(server, folders):
    """Greedy requests run while the weights swap; each answer matches the weights of the version it reports."""
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["weight_version"] == "0" and info["model_path"] == os.path.basename(folders["v0"])  # a name
    expected = {"0": hf_greedy(folders["v0"], PROMPT, 12)[0], "1": hf_greedy(folders["v1"], PROMPT, 12)[0]}
    assert expected["0"] != expected["1"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = [pool.submit(generate, server.url, greedy_body(PROMPT)) for _ in range(8)]
        update = httpx.post(server.url + "/update_weights_from_disk",
                            json={"model_path": folders["v1"], "weight_version": 1}, timeout=120)
        stream += [pool.submit(generate, server.url, greedy_body(PROMPT)) for _ in range(8)]
        answers = [f.result().json() for f in stream]
    assert update.status_code == 200 and update.json() == {
        "success": True, "message": "Succeeded to update model weights.", "weight_version": "1"}
    for answer in answers:
        assert answer["output_ids"] == expected[answer["meta_info"]["weight_version"]]
    assert answers[-1]["meta_info"]["weight_version"] == "1"  # sent after the update answered
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["weight_version"] == "1" and info["model_path"] == os.path.basename(folders["v1"])
    # An update without a version counts up from the current one.
    response = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": folders["v0"]}, timeout=120)
    assert response.json()["weight_version"] == "2"
    assert generate(server.url, greedy_body(PROMPT)).json()["output_ids"] == expected["0"]


def test_config_file_and_health(tmp_path, folders):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": {"path": folders["v0"], "dtype": "float32"},
                                  "serve": {"max_batch_size": 4, "weight_version": "7"}}))
    from drgrpo_jax.config.serve import load_serve_config
    loaded = load_serve_config(str(config), {"port": 0})
    assert (loaded.model, loaded.max_batch_size, loaded.weight_version, loaded.port) == (folders["v0"], 4, "7", 0)
    config.write_text(json.dumps({"serve": {"model": folders["v0"], "max_btch_size": 4}}))
    with pytest.raises(ValueError, match="serve.max_btch_size"):
        load_serve_config(str(config), {})


# ---------------------------------------------------------------------------------------------
# Every input answers 4xx, never 5xx; one bad row fails only its own request
# ---------------------------------------------------------------------------------------------

GOOD = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


def _with(params=None, **fields):
    body = {**GOOD, **fields}
    if params:
        body["sampling_params"] = {**GOOD["sampling_params"], **params}
    return body


@pytest.mark.parametrize("route,body,field", [
    ("/generate", _with({"top_k": 2**31}), "top_k"),
    ("/generate", _with({"stop_token_ids": [2**31]}), "stop_token_ids"),
    ("/generate", _with({"stop_token_ids": [VOCAB]}), "stop_token_ids: token id 64 is outside the vocabulary"),
    ("/generate", _with({"stop_token_ids": list(range(40))}), "stop_token_ids"),
    ("/generate", _with({"max_new_tokens": 2**40}), "max_new_tokens"),
    ("/generate", _with({"temperature": 1e300}), "temperature"),
    ("/generate", _with({"top_p": 1e-300}), "top_p"),
    ("/generate", _with({"n": 10**30}), "n"),
    ("/generate", _with(input_ids=[PROMPT, PROMPT], rid=["a"]), "rid: 1 ids for 2 prompts"),
    ("/generate", _with(input_ids=[PROMPT], rid=[]), "rid: 0 ids for 1 prompts"),
    ("/generate", _with(rid="x" * 50_000), "rid"),
    ("/generate", _with(rid="\ud800"), "rid"),
    ("/generate", _with(input_ids=[2**31]), "input_ids"),
    ("/generate", {"text": "a" * 20_000, "sampling_params": {"max_new_tokens": 2}}, "cannot fit the context"),
    ("/generate", {"text": "ab\ud800", "sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/v1/completions", {"prompt": "hi \ud800 there", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "top_k": 2**31}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "model": "m" * 10_000}, "model"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v" * 1_000_000}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "1 2"}, "weight_version"),
])
def test_out_of_range_fields_get_400_naming_them(server, route, body, field):
    response = httpx.post(server.url + route, content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    assert len(response.content) < 2000  # nothing echoed back in full
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_top_k_beyond_the_vocabulary_means_all_of_it(server):
    greedy = generate(server.url, greedy_body(PROMPT, 6)).json()["output_ids"]
    body = greedy_body(PROMPT, 6)
    body["sampling_params"]["top_k"] = 2**31 - 1
    assert generate(server.url, body).json()["output_ids"] == greedy


def test_chat_completions_need_a_chat_template(server):
    answer = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                        timeout=60)
    assert answer.status_code == 400 and "chat template" in answer.json()["error"]["message"]


def test_the_readme_curl_example_works_and_a_form_body_says_what_to_send(server):
    import re
    import subprocess

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        readme = f.read()
    example = re.search(r"(curl -s localhost:30000/generate .*?\}\}')", readme, re.S).group(1)
    command = example.replace("localhost:30000", server.url.removeprefix("http://"))
    answer = json.loads(subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                                       check=True).stdout)
    assert len(answer) == 4 and all(len(a["output_ids"]) <= 16 for a in answer)
    form = httpx.post(server.url + "/generate", content=b'{"input_ids": [1]}',
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 400 and "Content-Type: application/json" in form.json()["error"]["message"]


def test_openapi_documents_400_not_422(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    responses = spec["paths"]["/generate"]["post"]["responses"]
    assert "422" not in responses and {"400", "401", "429"} <= set(responses)


def test_one_failing_request_does_not_fail_its_batch_mates(folders):
    """The scheduler, in process: a row that makes the sampler raise fails its own request; the other is answered."""
    from drgrpo_jax.config.serve import ServeConfig
    from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
    from drgrpo_jax.serve.scheduler import Scheduler

    scheduler = Scheduler(ServeConfig(model=folders["v0"], batch_wait_ms=300, max_queued_tokens=100))
    real = scheduler.run_batch

    def poisoned(weights, rows, **kwargs):
        if any(r.prompt_ids[0] == 63 for r in rows):
            raise RuntimeError("poisoned row")
        return real(weights, rows, **kwargs)

    scheduler.run_batch = poisoned
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    try:
        good = scheduler.submit([RowRequest((5, 9), params, 0, 0, 0)])
        bad = scheduler.submit([RowRequest((63, 9), params, 0, 0, 0)])
        assert len(good.result(timeout=120)[0].output_ids) <= 3
        with pytest.raises(RuntimeError, match="poisoned"):
            bad.result(timeout=120)
        # The queue bound: beyond max_queued_tokens of outstanding work, submit refuses with a retry delay.
        from drgrpo_jax.errors import QueueFull
        slow = scheduler.submit([RowRequest((5, 9), SamplingParams(max_new_tokens=40), 0, 0, 0)])
        with pytest.raises(QueueFull) as busy:
            scheduler.submit([RowRequest((5, 9), SamplingParams(max_new_tokens=60), 0, 0, 0)])
        assert 1 <= busy.value.retry_after_s <= 60
        # A cancelled request (its client went away) is dropped at the batch boundary, not sampled.
        dropped = scheduler.submit([RowRequest((7, 9), params, 0, 0, j) for j in range(3)])
        dropped.cancel()
        slow.result(timeout=120)
        deadline = time.monotonic() + 30
        while scheduler.rows_dropped < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.rows_dropped == 3 and scheduler.queued_tokens == 0
    finally:
        scheduler.close()


# ---------------------------------------------------------------------------------------------
# Keys, weight roots, backpressure: a service started as on a pod
# ---------------------------------------------------------------------------------------------

API_KEY, ADMIN_KEY = "test-api-key-1", "test-admin-key-2"


@pytest.fixture(scope="module")
def keyed(folders, tmp_path_factory):
    """A service with an API key, an admin key, one weights root and small budgets (2 rows per batch)."""
    root = tmp_path_factory.mktemp("weights_root")
    shutil.copytree(folders["v1"], root / "v1")
    os.symlink(folders["v0"], root / "link_out")  # a symlink leading out of the root
    env = {"SERVE_KEY": API_KEY, "SERVE_ADMIN_KEY": ADMIN_KEY}
    with LocalServer(folders["v0"], env=env, api_key_env="SERVE_KEY", weights_roots=[str(root)],
                     extra_args=["--admin-key-env", "SERVE_ADMIN_KEY", "--max-batch-size", "2",
                                 "--max-request-tokens", "2500", "--max-queued-tokens", "3000",
                                 "--max-body-bytes", "100000"]) as srv:
        yield srv, root


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys_are_required_everywhere_but_health(keyed):
    import requests

    server, _ = keyed
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    for method, path in [("GET", "/get_model_info"), ("GET", "/v1/models"), ("GET", "/openapi.json"),
                         ("POST", "/generate"), ("POST", "/update_weights_from_disk")]:
        for headers in [{}, _auth("wrong"), {"Authorization": API_KEY}]:
            response = requests.request(method, server.url + path, json=GOOD, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    answer = requests.post(server.url + "/generate", json=GOOD, headers=_auth(API_KEY), timeout=120)
    assert answer.status_code == 200 and answer.json()["meta_info"]["weight_version"] == "0"
    assert requests.post(server.url + "/generate", json=GOOD, headers=_auth(ADMIN_KEY), timeout=120).ok


def test_the_openai_client_authenticates_with_api_key(keyed):
    import openai

    server, _ = keyed
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_weight_pushes_need_the_admin_key_and_a_path_under_the_root(keyed, folders, tmp_path):
    import requests

    server, root = keyed
    url = server.url + "/update_weights_from_disk"

    def push(path, key=ADMIN_KEY, version="5"):
        return requests.post(url, json={"model_path": path, "weight_version": version}, headers=_auth(key),
                             timeout=120)

    assert push(str(root / "v1"), key=API_KEY).status_code == 401  # the API key cannot swap weights
    outside = ["/etc", str(root / ".." / "x"), f"{root}/v1/../../{os.path.basename(folders['v0'])}",
               os.path.relpath(root / "v1"), "v1", str(root / "link_out"), "file://" + str(root / "v1"),
               "hf://Qwen/Qwen2.5-0.5B", "gs://bucket/weights/v1", str(tmp_path)]
    for path in outside:
        response = push(path)
        assert response.status_code == 403, (path, response.text)
        message = response.json()["message"]
        assert message.startswith("model_path: not allowed") and "No such file" not in message, message
    assert push(str(root / "missing")).json()["message"] == "model_path: not a valid model folder"
    ok = push(str(root / "v1"))
    assert ok.status_code == 200 and ok.json()["weight_version"] == "5"
    older = push(str(root / "v1"), version="4")
    assert older.status_code == 400 and "weight_version: 4 is older" in older.json()["message"]
    assert push(str(root / "v1"), version=5).status_code == 200  # the same version again: an idempotent re-push
    info = requests.get(server.url + "/get_model_info", headers=_auth(API_KEY), timeout=30).json()
    assert info["weight_version"] == "5"


def test_budgets_bodies_queue_and_disconnects(keyed):
    import requests

    server, _ = keyed
    headers = _auth(API_KEY)
    too_big = requests.post(server.url + "/generate", data=b"[" + b"1," * 60_000 + b"1]",
                            headers={**headers, "content-type": "application/json"}, timeout=30)
    assert too_big.status_code == 413 and "100000" in too_big.json()["error"]["message"]
    over = requests.post(server.url + "/generate", headers=headers, timeout=30, json={
        "input_ids": [PROMPT] * 4, "sampling_params": {"max_new_tokens": 200, "n": 4}})
    assert over.status_code == 400 and "max_request_tokens=2500" in over.json()["error"]["message"]
    # While a large request is queued, another as large finds the queue full: 429 + Retry-After. The first
    # client then leaves: its rows not yet sampled are dropped at the next batch boundary (2 rows per batch).
    big = {"input_ids": [PROMPT], "sampling_params": {"max_new_tokens": 200, "n": 10, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leaving = pool.submit(requests.post, server.url + "/generate", json=big, headers=headers, timeout=(5, 1.5))
        time.sleep(0.5)
        busy = requests.post(server.url + "/generate", json=big, headers=headers, timeout=120)
        assert busy.status_code == 429, busy.text
        assert 1 <= int(busy.headers["retry-after"]) <= 60 and "busy" in busy.json()["error"]["message"]
        with pytest.raises(requests.exceptions.ReadTimeout):
            leaving.result()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = requests.get(server.url + "/get_model_info", headers=headers, timeout=30).json()
        if info["queued_tokens"] == 0:
            break
        time.sleep(0.1)
    assert info["rows_dropped"] >= 4 and info["queued_tokens"] == 0, info
    start = time.monotonic()
    assert requests.post(server.url + "/generate", json=GOOD, headers=headers, timeout=60).ok
    assert time.monotonic() - start < 10


def test_non_loopback_needs_a_key_and_keys_come_from_the_environment():
    from drgrpo_jax.config.serve import normalize_roots
    from drgrpo_jax.serve import parse_args
    from drgrpo_jax.serve.security import Keys, confine_weight_path, read_keys

    for argv in (["--host", "0.0.0.0"], ["--host", "10.1.2.3"], ["--host", "myhost.internal"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *argv])
    assert parse_args(["--model", "m", "--host", "0.0.0.0", "--api-key-env", "K"]).api_key_env == "K"
    assert parse_args(["--model", "m", "--host", "0.0.0.0", "--allow-unauthenticated"]).allow_unauthenticated
    assert parse_args(["--model", "m", "--host", "::1"]).loopback
    with pytest.raises(ValueError, match="api_key_env: environment variable K is not set"):
        read_keys("K", "", {})
    assert read_keys("K", "A", {"K": "k", "A": "a"}) == Keys("k", "a")
    roots = normalize_roots(["/srv/run/weights", "gs://bucket/run"])
    assert confine_weight_path("gs://bucket/run/v3", roots, required=True) == "gs://bucket/run/v3"
    for bad in ["gs://bucket/run/../other/v3", "gs://bucket/runx/v3", "gs://other/run/v3", "/srv/run/weights2/v1"]:
        with pytest.raises(Exception, match="not allowed"):
            confine_weight_path(bad, roots, required=True)
    with pytest.raises(Exception, match="no --weights-root"):
        confine_weight_path("/srv/run/weights/v1", (), required=True)
    assert confine_weight_path("anything", (), required=False) == "anything"


def test_non_loopback_refusal_is_one_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "drgrpo_jax.serve", "--model", str(tmp_path), "--host",
                             "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "host: 0.0.0.0 is reachable from other machines" in result.stderr.splitlines()[-1]


def test_the_tokenizer_comes_from_the_projects_loader_and_none_means_token_ids_only(tmp_path, caplog):
    from drgrpo_jax.config.serve import ServeConfig
    from drgrpo_jax.serve import served_tokenizer

    from support.tiny_models import save_char_tokenizer

    with_tokenizer, without = tmp_path / "with", tmp_path / "without"
    save_char_tokenizer(str(with_tokenizer), "ab")
    without.mkdir()
    assert served_tokenizer(ServeConfig(model=str(with_tokenizer)))("ab")["input_ids"][-2:] == [3, 4]
    assert served_tokenizer(ServeConfig(model="gs://bucket/model", tokenizer=str(with_tokenizer))) is not None
    with caplog.at_level("WARNING", logger="drgrpo_jax.serve"):
        assert served_tokenizer(ServeConfig(model=str(without))) is None
        assert served_tokenizer(ServeConfig(model="gs://bucket/model")) is None
    assert [r.getMessage().endswith("text prompts will be refused") for r in caplog.records] == [True, True]
