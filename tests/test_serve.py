"""The generation service as a real child process: SGLang-style API, OpenAI client, weight swaps, bad input."""

import concurrent.futures
import json
import os
import shutil

import httpx
import numpy as np
import pytest

from drgrpo_jax.rollout import LocalServer

from helpers import write_tiny_llama

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
    after = httpx.get(server.url + "/get_model_info").json()["batches_run"]
    assert after - before < len(prompts)  # fewer batches than requests: they were batched together
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
    for path, reason in [(folders["corrupt"], ""), (folders["wider"], "hidden_size"),
                         (str(tmp_path / "missing"), "missing"), (str(no_config), "config.json")]:
        response = httpx.post(server.url + "/update_weights_from_disk",
                              json={"model_path": path, "weight_version": "99"}, timeout=120)
        assert response.status_code == 400 and response.json()["success"] is False
        assert reason in response.json()["message"]
        assert httpx.get(server.url + "/get_weight_version").json()["weight_version"] == version
        assert generate(server.url, greedy_body(PROMPT)).json()["output_ids"] == before


def test_weight_update_mid_stream_changes_version_and_outputs(server, folders):
    """Greedy requests run while the weights swap; each answer matches the weights of the version it reports."""
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["weight_version"] == "0" and info["model_path"] == folders["v0"]
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
    assert info["weight_version"] == "1" and info["model_path"] == folders["v1"]
    # An update without a version counts up from the current one.
    response = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": folders["v0"]}, timeout=120)
    assert response.json()["weight_version"] == "2"
    assert generate(server.url, greedy_body(PROMPT)).json()["output_ids"] == expected["0"]


def test_config_file_and_health(tmp_path, folders):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": {"path": folders["v0"], "dtype": "float32"},
                                  "serve": {"max_batch_size": 4, "weight_version": "7"}}))
    from drgrpo_jax.serve import load_config
    loaded = load_config(str(config), {"port": 0})
    assert (loaded.model, loaded.max_batch_size, loaded.weight_version, loaded.port) == (folders["v0"], 4, "7", 0)
    config.write_text(json.dumps({"serve": {"model": folders["v0"], "max_btch_size": 4}}))
    with pytest.raises(ValueError, match="serve.max_btch_size"):
        load_config(str(config), {})
