"""Issue #44's findings against the service, in process (FastAPI's TestClient over a real Scheduler on the tiny model):
each test failed on main at 4e341fd and holds here. Hostile paths, error shapes, request bounds, numerics."""

import os
import shutil

import numpy as np
import pytest
from fastapi.testclient import TestClient

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.serve.app import build_app
from drgrpo_jax.serve.scheduler import Scheduler

from support.tiny_models import write_tiny_llama

PEAKED = {"vocab_size": 64, "initializer_range": 0.5, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A weights root with a model in it, and a model of the same shape outside it (other weights)."""
    base = tmp_path_factory.mktemp("hostile")
    inside = write_tiny_llama(str(base / "weights" / "run" / "step"), seed=1, **PEAKED)
    outside = write_tiny_llama(str(base / "outside" / "step"), seed=7, **PEAKED)
    served = write_tiny_llama(str(base / "served"), seed=0, **PEAKED)
    return {"root": str(base / "weights"), "inside": inside, "outside": outside, "served": served,
            "base": str(base)}


def _client(scheduler: Scheduler, tokenizer=None) -> TestClient:
    return TestClient(build_app(scheduler, tokenizer), base_url="http://localhost", raise_server_exceptions=False)


@pytest.fixture(scope="module")
def scheduler(root):
    scheduler = Scheduler(ServeConfig(model=root["served"], weights_roots=(root["root"],), max_batch_size=8,
                                batch_wait_ms=1.0))
    yield scheduler
    scheduler.close()


def _embed(weights) -> np.ndarray:
    return np.asarray(weights.state["embed"][...])


def _loaded_embed(path: str) -> np.ndarray:
    from drgrpo_jax.serve.weights import load_weights

    return _embed(load_weights(path, "float32", "x"))


def _push(client: TestClient, path: str, version: str) -> tuple[int, dict]:
    answer = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version,
                                                            "allow_rollback": True})
    return answer.status_code, answer.json()


def test_a_null_byte_in_a_weight_path_is_403_naming_the_rule(scheduler, root):
    client = _client(scheduler)
    for path in (root["inside"] + "\x00", "\x00", root["root"] + "/\x00/../x"):
        status, body = _push(client, path, "1")
        assert status == 403, body  # main: 500 (realpath raised ValueError: embedded null byte)
        assert "NUL" in body["message"], body
    status, body = _push(client, root["root"] + "/run/../../outside/step", "1")
    assert status == 403 and "'..'" in body["message"], body


def test_swapping_a_folder_for_a_symlink_during_the_load_cannot_escape_the_root(scheduler, root, monkeypatch):
    """The race, made deterministic: the folder is swapped for a link out of the root once the path was checked,
    just before the loader reads it. The files read are those opened when the path was checked."""
    from drgrpo_jax.serve import weights as weights_module

    run = os.path.join(root["root"], "run")
    real_load = weights_module.from_pretrained
    inside = _loaded_embed(root["inside"])

    def swap_then_load(path, **kwargs):
        os.rename(run, run + "_moved")
        os.symlink(os.path.dirname(root["outside"]), run)
        return real_load(path, **kwargs)

    monkeypatch.setattr(weights_module, "from_pretrained", swap_then_load)
    try:
        status, body = _push(_client(scheduler), root["inside"], "2")
    finally:
        os.remove(run)
        os.rename(run + "_moved", run)
    assert status == 200, body
    np.testing.assert_array_equal(_embed(scheduler.weights), inside)  # main: the outside's weights were served


def test_a_weight_file_symlinked_out_of_the_root_is_refused(scheduler, root):
    folder = os.path.join(root["root"], "linked")
    shutil.copytree(root["inside"], folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    os.symlink(os.path.join(root["outside"], "model.safetensors"), os.path.join(folder, "model.safetensors"))
    before = _embed(scheduler.weights)
    status, body = _push(_client(scheduler), folder, "3")
    assert status == 403 and "symbolic link" in body["message"] and "model.safetensors" in body["message"], body
    np.testing.assert_array_equal(_embed(scheduler.weights), before)  # main: 200, the outside's weights served
    link = os.path.join(root["root"], "link")
    os.symlink(root["inside"], link)  # a link below the root, even to a folder inside it, is refused too
    status, body = _push(_client(scheduler), link, "3")
    assert status == 403 and "symbolic link" in body["message"], body


def test_a_missing_folder_under_the_root_is_400_and_a_real_one_loads(scheduler, root):
    client = _client(scheduler)
    status, body = _push(client, os.path.join(root["root"], "nowhere"), "4")
    assert status == 400 and body["message"] == "model_path: not a valid model folder", body
    status, body = _push(client, root["inside"], "4")
    assert status == 200 and body["weight_version"] == "4", body
    np.testing.assert_array_equal(_embed(scheduler.weights), _loaded_embed(root["inside"]))


def _is_openai_error(answer, status: int, *words: str) -> None:
    assert answer.status_code == status, (answer.status_code, answer.text)
    error = answer.json()["error"]
    assert isinstance(error["message"], str) and error["code"] == status and error["type"], error
    for word in words:
        assert word in error["message"], (word, error)


def test_every_error_is_in_openais_shape(scheduler):
    client = _client(scheduler)
    _is_openai_error(client.get("/no/such/route"), 404, "/no/such/route")
    _is_openai_error(client.get("/generate"), 405, "GET")
    _is_openai_error(client.post("/generate", content=b"\xff\xfe{", headers={"content-type": "application/json"}),
                     400, "body")
    _is_openai_error(client.post("/generate", content=b"[" * 100_000 + b"]" * 100_000,
                                 headers={"content-type": "application/json"}), 400, "body")
    long_int = b'{"input_ids": [' + b"9" * 5000 + b"]}"
    _is_openai_error(client.post("/generate", content=long_int, headers={"content-type": "application/json"}),
                     400, "body")
    assert "detail" not in client.get("/nowhere").json()


def test_an_unexpected_failure_is_500_in_openais_shape(scheduler, monkeypatch):
    from drgrpo_jax.serve import native_routes

    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(native_routes, "_per_prompt", broken)
    answer = _client(scheduler).post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    _is_openai_error(answer, 500, "internal error")
    assert "boom" not in answer.text  # nothing of the server's internals goes to the client


def test_a_chunked_body_over_the_limit_is_413(root):
    scheduler = Scheduler(ServeConfig(model=root["served"], max_body_bytes=1000))
    try:
        client = _client(scheduler)

        def chunks():
            yield b'{"input_ids": ['
            for _ in range(200):
                yield b"1, 2, 3, 4, 5, "
            yield b"1]}"

        answer = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        _is_openai_error(answer, 413, "body", "1000")  # main: 400 "There was an error parsing the body"
    finally:
        scheduler.close()


def test_top_logprobs_without_logprobs_is_refused_before_any_work(scheduler, root):
    from drgrpo_jax.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(root["served"], None)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    client = _client(scheduler, tokenizer)
    before = scheduler.batches_run
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "top_logprobs": 2, "max_tokens": 4})
    _is_openai_error(answer, 400, "top_logprobs")
    assert scheduler.batches_run == before  # main: refused only after the batch had run


def test_chat_without_max_tokens_gets_the_operators_default_and_a_limit(root):
    from drgrpo_jax.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(root["served"], None)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    scheduler = Scheduler(ServeConfig(model=root["served"], default_max_tokens=8, max_tokens_limit=64))
    client = _client(scheduler, tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8  # main: the rest of the context (~250)
    for route, payload in (("/v1/chat/completions", body), ("/v1/completions", {"prompt": [3, 4]})):
        for field in ("max_tokens", "max_completion_tokens") if "chat" in route else ("max_tokens",):
            _is_openai_error(client.post(route, json={**payload, field: 65}), 400, field, "64")
    scheduler.close()


def test_tiny_temperatures_are_greedy_and_every_logprob_is_finite(scheduler):
    client = _client(scheduler)
    greedy = client.post("/generate", json={"input_ids": [5, 9, 14], "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}).json()
    for temperature in (1e-6, 1e-9, 1e-20, 1e-37, 5e-324):
        body = {"input_ids": [5, 9, 14], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": temperature}}
        answer = client.post("/generate", json=body).json()
        logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        assert answer["output_ids"] == greedy["output_ids"], temperature
        assert all(lp is not None and np.isfinite(lp) for lp in logprobs), (temperature, logprobs)
        completion = client.post("/v1/completions", json={"prompt": [5, 9, 14], "max_tokens": 4, "logprobs": 1,
                                                          "temperature": temperature}).json()
        assert all(np.isfinite(lp) for lp in completion["choices"][0]["logprobs"]["token_logprobs"]), completion


def test_segment_names_must_match_whole(scheduler):
    body = {"segment": "drgrpo_weights_1_1\n", "weight_version": "1",
            "tensors": [{"name": "embed", "dtype": "float32", "shape": [1], "offset": 0}]}
    answer = _client(scheduler).post("/update_weights_from_tensor", json=body)
    _is_openai_error(answer, 400, "segment")
    assert "drgrpo_weights_<pid>_<random>/v<version>_<random>" in answer.json()["error"]["message"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_segment_another_user_owns_or_may_write_is_refused(scheduler):
    """Issue #57: the service maps a segment only when it is a private file of its own user's."""
    from drgrpo_jax import named_tensors

    folder, served = named_tensors.make_folder(), scheduler.weights.version
    name = named_tensors.segment_name(folder, 1)
    try:
        entries = named_tensors.write_segment(name, {"embed": np.zeros(4, np.float32)})
        body = {"segment": name, "weight_version": "1", "allow_rollback": True,
                "tensors": [entry.to_json() for entry in entries]}
        path = os.path.join(named_tensors.SEGMENT_DIR, name)
        for owner, mode, reason in [(65534, 0o600, "owned by another user"), (0, 0o666, "open to others")]:
            os.chown(path, owner, owner)
            os.chmod(path, mode)
            answer = _client(scheduler).post("/update_weights_from_tensor", json=body)
            _is_openai_error(answer, 400, reason)
        assert scheduler.weights.version == served
    finally:
        named_tensors.remove_folder(folder)


def _reference_scores(model, sequence: list[int], temperature: float, top: int):
    """log p(token i | tokens < i) and the top entries, from the model's whole logits (the oracle)."""
    import jax
    import jax.numpy as jnp

    logits = model(jnp.asarray([sequence], jnp.int32))[0, :-1] / temperature
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    token = logprobs[np.arange(len(sequence) - 1), sequence[1:]]
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :top]
    return token, np.take_along_axis(logprobs, order, -1), order


def test_scoring_in_tiles_matches_the_whole_logits():
    from flax import nnx

    from drgrpo_jax.serve.scoring import score_sequences, tile_sizes

    from support.tiny_models import SAMPLER_VOCAB, tiny_sampler_model

    model = tiny_sampler_model()
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, SAMPLER_VOCAB, size).tolist() for size in (40, 7, 23)]
    assert tile_sizes(4, 64, SAMPLER_VOCAB, 4, 1) == (1, SAMPLER_VOCAB)  # as small as tiles get
    for max_bytes in (1, 4 * 16 * 100 * 4 * 4, 2**30):  # one position a tile, 16 positions, everything at once
        scored = score_sequences(graphdef, state, sequences, [0.7, 0.0, 1.3], 3, SAMPLER_VOCAB, max_bytes)
        for sequence, temperature, got in zip(sequences, [0.7, 1.0, 1.3], scored):
            token, top_values, top_ids = _reference_scores(model, sequence, temperature, 3)
            np.testing.assert_allclose(got.token_logprobs, token, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(got.top_logprobs, top_values, rtol=2e-5, atol=2e-5)
            assert got.top_ids == top_ids.tolist()


def test_scoring_memory_is_bounded_by_max_scoring_bytes():
    """8 rows x 512 positions x a 32,768 vocabulary: untiled, each float32 logits array is 512 MiB; tiled under a
    32 MiB bound the whole program's temporaries stay under 4x that (attention's own included)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.serve import scoring

    config = DecoderConfig(family="llama", vocab_size=32768, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rows, length, bound = 8, 512, 32 * 2**20
    positions, entries = scoring.tile_sizes(rows, length, config.vocab_size, 1, bound)
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    compiled = scoring._score.lower(graphdef, state, ids, ids, jax.ShapeDtypeStruct((rows,), jnp.float32), top=1,
                                    positions=positions, entries=entries).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries < 4 * bound, (temporaries, positions, entries)
    assert rows * length * config.vocab_size * 4 == 16 * bound  # what one untiled array would have taken


def test_a_request_past_its_deadline_is_answered_with_abort(root):
    """--request-timeout-s: a request is answered by its deadline; rows not sampled by then come back empty with
    finish reason abort (here the worker is held by a slow batch)."""
    import threading
    import time

    scheduler = Scheduler(ServeConfig(model=root["served"], request_timeout_s=1.0))
    release = threading.Event()
    real_run = scheduler.run_batch

    def slow_run(weights, rows, **kwargs):
        release.wait(30)
        return real_run(weights, rows, **kwargs)

    scheduler.run_batch = slow_run
    try:
        client = _client(scheduler)
        start = time.monotonic()
        answer = client.post("/generate", json={"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 4}})
        chat = client.post("/v1/completions", json={"prompt": [5, 9], "max_tokens": 4})
        assert time.monotonic() - start < 10
        assert answer.status_code == 200 and chat.status_code == 200, (answer.text, chat.text)
        assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort" and answer.json()["output_ids"] == []
        assert chat.json()["choices"][0]["finish_reason"] == "abort"
    finally:
        release.set()
        scheduler.close()


# SGLang's sampling parameters, the API fields of `class SamplingParams` in sgl-project/sglang
# python/sglang/srt/sampling/sampling_params.py (commit 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03), documented in
# its docs/basic_usage/sampling_params: each with a value SGLang accepts and that means "off" where it is off.
SGLANG_SAMPLING_PARAMS = {
    "max_new_tokens": 3, "stop": ["zz"], "stop_token_ids": [2], "stop_regex": None, "temperature": 0.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None,
    "sampling_seed": 11,
}
NOT_IMPLEMENTED = {"min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
                   "min_new_tokens": 2, "no_stop_trim": True, "regex": "a+", "json_schema": "{}", "ebnf": "x",
                   "stop_regex": "a", "logit_bias": {"3": 1.0}}


def test_generate_accepts_sglangs_sampling_parameters_and_names_any_other(scheduler, root):
    from drgrpo_jax.models.pretrained import load_tokenizer

    client = _client(scheduler, load_tokenizer(root["served"], None))
    prompt = {"input_ids": [5, 9, 14], "return_logprob": True}
    answer = client.post("/generate", json={**prompt, "sampling_params": SGLANG_SAMPLING_PARAMS})
    assert answer.status_code == 200, answer.text  # main: 400 on stop, min_p, sampling_seed, ... (extra fields)
    alias = client.post("/generate", json={**prompt, "sampling_params": {
        **{k: v for k, v in SGLANG_SAMPLING_PARAMS.items() if k != "sampling_seed"}, "seed": 11}})
    assert alias.json()["output_ids"] == answer.json()["output_ids"]
    for name, value in NOT_IMPLEMENTED.items():
        refused = client.post("/generate", json={**prompt, "sampling_params": {name: value}})
        _is_openai_error(refused, 400, f"sampling_params.{name}", "not supported")
    _is_openai_error(client.post("/generate", json={**prompt, "sampling_params": {"bogus_knob": 1}}), 400,
                     "sampling_params.bogus_knob")
    _is_openai_error(client.post("/generate", json={**prompt, "sampling_params": {"seed": 1, "sampling_seed": 2}}),
                     400, "sampling_seed")


def test_generate_stop_strings_cut_the_completion_as_sglang_reports_them(scheduler, root):
    from drgrpo_jax.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(root["served"], None)
    client = _client(scheduler, tokenizer)
    body = {"input_ids": [5, 9, 14], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    full = client.post("/generate", json=body).json()
    stop = full["text"][3:5]
    assert stop, full
    cut = client.post("/generate", json={**body, "sampling_params": {**body["sampling_params"], "stop": stop}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert full["text"].startswith(cut["text"]) and stop not in cut["text"]
    assert cut["output_ids"] == full["output_ids"][:len(cut["output_ids"])]
    assert len(cut["meta_info"]["output_token_logprobs"]) == len(cut["output_ids"]) < len(full["output_ids"])


def test_a_short_request_does_not_wait_behind_a_long_batch(root):
    """A batch of long completions holds the main worker; a short request (a one-token completion, what a probe
    sends) is answered by the short-request worker meanwhile, with the tokens it gets on an idle service."""
    import concurrent.futures
    import threading
    import time

    scheduler = Scheduler(ServeConfig(model=root["served"], short_request_tokens=8))
    release, long_started = threading.Event(), threading.Event()
    real_run = scheduler.run_batch

    def held_when_long(weights, rows, **kwargs):
        if max(r.params.max_new_tokens for r in rows) > 8:
            long_started.set()
            release.wait(120)
        return real_run(weights, rows, **kwargs)

    scheduler.run_batch = held_when_long
    client = _client(scheduler)
    short = {"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    try:
        alone = client.post("/generate", json=short).json()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(client.post, "/generate", json={"input_ids": [5, 9],
                                                               "sampling_params": {"max_new_tokens": 64}})
            assert long_started.wait(60)
            start = time.monotonic()
            answer = client.post("/generate", json=short)
            assert time.monotonic() - start < 30 and answer.json()["output_ids"] == alone["output_ids"]
            release.set()
            assert long.result(timeout=120).status_code == 200
    finally:
        release.set()
        scheduler.close()


# ---------------------------------------------------------------- issue #57: each failed on main at a433d1c


@pytest.mark.parametrize("host", ["127.0.0.1:80@evil", "localhost@evil.com", "localhost:80@127.0.0.1",
                                  "[::1]evil", "localhost:8x", "localhost:80:80", "localhost/evil", "localhost?x",
                                  "localhost:99999", "local\thost", "[localhost]", "evil.com", ""])
def test_a_host_header_that_is_not_a_loopback_host_and_port_is_refused(scheduler, host):
    answer = _client(scheduler).get("/health", headers={"host": host})
    _is_openai_error(answer, 400, "Host")  # main: 200 for 127.0.0.1:80@evil, localhost:80@127.0.0.1, ...


def test_a_loopback_host_with_or_without_a_port_is_served(scheduler):
    for host in ("localhost", "LOCALHOST:30000", "127.0.0.1:1", "[::1]:30000", "[0:0::1]", "localhost:"):
        assert _client(scheduler).get("/health", headers={"host": host}).status_code == 200, host


def test_responses_name_the_model_and_never_show_a_server_path(root):
    from drgrpo_jax.serve.service import shown_name

    scheduler = Scheduler(ServeConfig(model=root["served"], weights_roots=(root["root"],), short_request_tokens=0))
    try:
        client = _client(scheduler)
        for route in ("/get_model_info", "/v1/models"):
            answer = client.get(route)
            assert answer.status_code == 200 and root["base"] not in answer.text, answer.text  # main: the folder
        info = client.get("/get_model_info").json()
        assert info["model_path"] == info["tokenizer_path"] == "served"  # the same fields, a name in each
        assert client.get("/v1/models").json()["data"][0]["id"] == "served"
        assert _push(client, root["inside"], "9")[0] == 200
        pushed = client.get("/get_model_info")
        assert pushed.json()["model_path"] == "step" and root["base"] not in pushed.text, pushed.text
    finally:
        scheduler.close()
    named = Scheduler(ServeConfig(model=root["served"], served_model_name="tiny-v1"))
    try:
        assert _client(named).get("/v1/models").json()["data"][0]["id"] == "tiny-v1"
    finally:
        named.close()
    assert shown_name("org/tiny@main") == "org/tiny@main" and shown_name("gs://bucket/run/step_8/") == "step_8"


def test_openais_neutral_penalties_are_accepted_and_others_refused_as_not_supported(scheduler, root):
    from drgrpo_jax.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(root["served"], None)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    client = _client(scheduler, tokenizer)
    bodies = {"/v1/completions": {"prompt": [5, 9], "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    for route, body in bodies.items():
        for neutral in (0, 0.0, None):
            answer = client.post(route, json={**body, "presence_penalty": neutral, "frequency_penalty": neutral})
            assert answer.status_code == 200, (route, neutral, answer.text)  # main: 400, extra fields
        for field in ("presence_penalty", "frequency_penalty"):
            _is_openai_error(client.post(route, json={**body, field: 0.5}), 400, field, "not supported")


def test_scoring_past_its_deadline_stops_within_one_batch(root, monkeypatch):
    """Eight prompts scored (logprobs) on a service of 2-row batches; the first scoring program is held until the
    answer (abort, at the deadline) is out. Main scored all eight rows in one program that ran on after the answer
    (53 CPU-seconds in the probe); here the scoring stops at its next batch."""
    import threading
    import time

    from drgrpo_jax.serve import scoring

    scheduler = Scheduler(ServeConfig(model=root["served"], max_batch_size=2, request_timeout_s=3.0,
                                short_request_tokens=0))
    body = {"prompt": [[5, 9, i] for i in range(3, 11)], "max_tokens": 2, "temperature": 0}
    answered, rows_scored, real_score = threading.Event(), [], scoring._score

    def held_score(graphdef, state, ids, segments, *args, **kwargs):
        rows_scored.append(int((np.asarray(segments).sum(axis=1) > 0).sum()))
        if len(rows_scored) == 1:
            answered.wait(60)
        return real_score(graphdef, state, ids, segments, *args, **kwargs)

    try:
        client = _client(scheduler)
        for _ in range(20):  # until the sampler's programs are compiled: sampling then ends well within 3 s
            if client.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"] != "abort":
                break
        monkeypatch.setattr(scoring, "_score", held_score)
        answer = client.post("/v1/completions", json={**body, "logprobs": 1})
        answered.set()
        assert answer.status_code == 200, answer.text
        assert {c["finish_reason"] for c in answer.json()["choices"]} == {"abort"}
        assert all(c["logprobs"] is None for c in answer.json()["choices"])
        time.sleep(2)  # what the scoring thread does after the answer
        assert sum(rows_scored) <= 2, rows_scored  # main: [8]
    finally:
        answered.set()
        scheduler.close()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("long") / "model"), seed=0, vocab_size=64,
                            max_position_embeddings=4096)


def test_a_long_prompts_prefill_stops_at_the_deadline(long_model, monkeypatch):
    """A 2,500-token prompt (4,096 prompt slots) is prefilled 1,024 columns a program, asking between them whether
    its client still waits; the first program is held until the answer (abort, at the deadline) is out. Main ran
    the whole prefill as one program however long it took, and the worker was busy with it after the answer."""
    import threading
    import time

    from drgrpo_jax.sampler import generate as driver  # the module: the programs it calls are wrapped below

    scheduler = Scheduler(ServeConfig(model=long_model, request_timeout_s=2.0, short_request_tokens=0,
                                batch_wait_ms=1.0))
    answered, parts, prefills = threading.Event(), [], []
    real_part, real_prefill = driver.prefill_part, driver.prefill

    def held_part(*args, **kwargs):
        parts.append(1)
        if len(parts) == 1:
            answered.wait(60)
        return real_part(*args, **kwargs)

    def counted_prefill(*args, **kwargs):
        prefills.append(1)
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(driver, "prefill_part", held_part)
    monkeypatch.setattr(driver, "prefill", counted_prefill)
    prompt = np.random.default_rng(0).integers(3, 64, 2500).tolist()
    try:
        answer = _client(scheduler).post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, "sampling_seed": 1}})
        answered.set()
        assert answer.status_code == 200 and answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
        deadline = time.monotonic() + 120
        while scheduler.batches_run == 0:
            assert time.monotonic() < deadline, "the batch never ended"
            time.sleep(0.01)
        assert parts == [1] and prefills == [], (parts, prefills)  # main: the whole prefill ran after the answer
        assert scheduler.rows_cut == 1 and scheduler.batches_stopped == 1
    finally:
        answered.set()
        scheduler.close()


@pytest.mark.slow
def test_a_long_prompt_prefilled_in_parts_samples_what_one_prefill_does(long_model, monkeypatch):
    """What the parts change is only the order of float sums: the tokens are those of the whole prefill."""
    from drgrpo_jax.sampler import generate as driver  # the module: its PREFILL_CHUNK is what generate reads
    from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, bucket, make_batch
    from drgrpo_jax.serve.weights import load_weights

    weights = load_weights(long_model, "float32", "0")
    rng = np.random.default_rng(0)
    rows = [RowRequest(tuple(rng.integers(3, 64, 2500).tolist()), SamplingParams(max_new_tokens=8), seed=1),
            RowRequest(tuple(rng.integers(3, 64, 30).tolist()), SamplingParams(max_new_tokens=8, temperature=0), 2)]
    batch = make_batch(rows, (2,), batch_size=2, prompt_len=bucket(2500), num_prompts=2)
    parts = driver.generate(weights.graphdef, weights.state, batch, max_new_tokens=16,
                            unwanted=lambda: [False, False], check_every=4)
    monkeypatch.setattr(driver, "PREFILL_CHUNK", 1 << 30)  # one program over the whole prompt
    whole = driver.generate(weights.graphdef, weights.state, batch, max_new_tokens=16)
    np.testing.assert_array_equal(np.asarray(parts.tokens_BT), np.asarray(whole.tokens_BT))
    np.testing.assert_allclose(np.asarray(parts.logprobs_BT), np.asarray(whole.logprobs_BT), atol=1e-4)


def test_a_prompt_over_the_memory_budget_is_refused_before_any_work(long_model):
    """A batch's sampler memory is estimated before it is admitted (sampler/memory.py): a prompt that alone needs
    more than --max-batch-bytes is a 400 naming the budget, on every route, and nothing runs. Main admitted a
    6,000-id prompt and its prefill took 8.5 GB."""
    scheduler = Scheduler(ServeConfig(model=long_model, max_batch_bytes=2**20, batch_wait_ms=1.0))
    try:
        assert scheduler.batch_bytes(1, 100, 4) < 2**20 < scheduler.batch_bytes(1, 2500, 4)
        client = _client(scheduler)
        prompt = [5] * 2500
        answer = client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "input_ids[0]: a prompt of 2500 tokens with 4 new tokens needs" in message, message
        assert "over the service's budget of 1 MiB a batch (--max-batch-bytes)" in message, message
        answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert answer.status_code == 400 and "--max-batch-bytes" in answer.text, answer.text
        assert client.post("/generate", json={"input_ids": [5] * 100, "sampling_params": {
            "max_new_tokens": 4}}).status_code == 200
        assert scheduler.batches_run == 1
        assert client.get("/get_model_info").json()["max_batch_bytes"] == 2**20
    finally:
        scheduler.close()


def test_batches_are_cut_to_fit_the_memory_budget(long_model):
    """Rows that fit max_batch_size but not the memory budget together run in as many batches as the budget
    takes; the tokens are those of one batch (a row's draws are its own)."""
    probe = Scheduler(ServeConfig(model=long_model))
    assert 0 < probe.batch_budget  # the default: half the device's free memory
    two = probe.batch_bytes(2, 300, 8)
    probe.close()
    budgeted = Scheduler(ServeConfig(model=long_model, max_batch_bytes=two, batch_wait_ms=1.0, short_request_tokens=0))
    free = Scheduler(ServeConfig(model=long_model, batch_wait_ms=1.0, short_request_tokens=0))
    body = {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 8, "n": 4, "sampling_seed": 3}}
    try:
        cut, whole = (_client(e).post("/generate", json=body) for e in (budgeted, free))
        assert cut.status_code == whole.status_code == 200, cut.text
        assert budgeted.batches_run == 2 and free.batches_run == 1
        assert [r["output_ids"] for r in cut.json()] == [r["output_ids"] for r in whole.json()]
    finally:
        budgeted.close()
        free.close()


@pytest.mark.heavy  # scoring programs compiled at long lengths
@pytest.mark.parametrize("mlp, vocab, rows, length", [(8192, 512, 2, 4096), (1024, 4096, 4, 2048)])
def test_a_scoring_calls_memory_is_the_estimate_the_budget_uses(mlp, vocab, rows, length):
    """`call_bytes` (the MLP's activations a layer at a time, and the logits tiles) against the compiled scoring
    program's temporaries, for a model whose MLP dominates and one whose vocabulary does."""
    import jax.numpy as jnp
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.serve import scoring

    config = DecoderConfig(family="llama", vocab_size=vocab, hidden_size=256, intermediate_size=mlp, num_layers=2,
                           num_heads=8, num_kv_heads=8, head_dim=32, max_position_embeddings=length)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    positions, entries = scoring.tile_sizes(rows, length, vocab, 1, 2**27)
    ids = jnp.ones((rows, length), jnp.int32)
    compiled = scoring._score.lower(graphdef, state, ids, ids, jnp.ones((rows,)), top=1, positions=positions,
                                    entries=entries).compile().memory_analysis()
    estimate = scoring.call_bytes(config, rows, length, 1, 2**27)
    assert compiled.temp_size_in_bytes <= estimate <= 1.25 * compiled.temp_size_in_bytes


@pytest.fixture(scope="module")
def wide_mlp_model(tmp_path_factory):
    """A model whose scoring forward (its MLP) outweighs its sampler batch: one head, a wide MLP."""
    return write_tiny_llama(str(tmp_path_factory.mktemp("wide") / "model"), seed=0, vocab_size=64,
                            max_position_embeddings=4096, intermediate_size=4096, num_attention_heads=1,
                            num_key_value_heads=1)


def test_scoring_is_cut_into_calls_that_fit_and_a_sequence_that_alone_does_not_is_refused(wide_mlp_model,
                                                                                        monkeypatch):
    """Log-prob scoring runs as many rows a call as the memory budget holds (main: --max-batch-size rows, however
    long), and a request whose one sequence's scoring would not fit is a 400 before anything is sampled."""
    from drgrpo_jax.serve import openai_routes, scoring

    probe = Scheduler(ServeConfig(model=wide_mlp_model))
    config, scoring_bytes = probe.weights.config, probe.config.max_scoring_bytes
    two = scoring.call_bytes(config, 2, 304, 1, scoring_bytes)  # two sequences of 300 + 4 tokens
    between = (probe.batch_bytes(1, 3000, 4) + scoring.call_bytes(config, 1, 3004, 1, scoring_bytes)) // 2
    assert probe.batch_bytes(1, 300, 4) <= two and probe.batch_bytes(1, 3000, 4) < between
    probe.close()
    calls = []
    real = scoring.score_sequences

    def counted(*args, rows_per_call, **kwargs):
        calls.append(rows_per_call)
        return real(*args, rows_per_call=rows_per_call, **kwargs)

    monkeypatch.setattr(openai_routes, "score_sequences", counted)
    scheduler = Scheduler(ServeConfig(model=wide_mlp_model, max_batch_bytes=two, max_batch_size=8, batch_wait_ms=1.0))
    try:
        answer = _client(scheduler).post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 4, "n": 8,
                                                               "logprobs": 1})
        assert answer.status_code == 200, answer.text
        assert calls == [2] and all(c["logprobs"] for c in answer.json()["choices"])  # main: [8]
    finally:
        scheduler.close()
    scheduler = Scheduler(ServeConfig(model=wide_mlp_model, max_batch_bytes=between, batch_wait_ms=1.0))
    try:
        long = _client(scheduler).post("/v1/completions", json={"prompt": [5] * 3000, "max_tokens": 4, "logprobs": 1})
        assert long.status_code == 400, long.text
        assert "logprobs: scoring a sequence of 3004 tokens needs" in long.text and "--max-batch-bytes" in long.text
        assert scheduler.batches_run == 0  # refused before anything was sampled
    finally:
        scheduler.close()
