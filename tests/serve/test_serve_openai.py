"""The service's OpenAI routes as a real child process: stop strings, logprobs, echo, chat completions (through the
official `openai` client), the exact requests lm-evaluation-harness's local-completions model sends, and
lm_eval itself against the service on a local JSONL task (slow)."""

import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from drgrpo_jax.rollout.local_service import LocalServer

from support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.subprocess  # the service runs as a child process

# A chat template the character tokenizer can spell: "s= ... u= ... a= ".
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}= {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}a= {% endif %}")
PEAKED = {"vocab_size": 64, "initializer_range": 0.5, "max_position_embeddings": 256}
PROMPT = [5, 9, 14, 3, 30]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Llama with a chat template in its tokenizer config."""
    path = write_tiny_llama(str(tmp_path_factory.mktemp("openai") / "chat"), seed=3, **PEAKED)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "chat_template": CHAT_TEMPLATE}, f)
    return path


@pytest.fixture(scope="module")
def server(model):
    with LocalServer(model, extra_args=["--max-batch-size", "8"]) as srv:
        yield srv


def completion(url: str, **body) -> dict:
    answer = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _tokenizer(path: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def hf_logprobs(path: str, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return np.asarray([logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))])


def test_stop_strings_cut_the_text_before_the_earliest_one(server, model):
    import openai

    full = completion(server.url, prompt="hello", max_tokens=16, temperature=0, ignore_eos=True)["choices"][0]
    text = full["text"]
    assert len(text) >= 8, text
    stop, later = text[4:6], text[6:8]
    cut = completion(server.url, prompt="hello", max_tokens=16, temperature=0, ignore_eos=True,
                     stop=[later, stop])["choices"][0]
    index, matched = min((text.find(s), s) for s in (later, stop))  # the earliest occurrence wins
    assert cut["text"] == text[:index] and cut["finish_reason"] == "stop"
    kept = cut["token_ids"]  # through the token that completed the stop string, as vLLM keeps them
    assert kept == full["token_ids"][:len(kept)]
    decode = _tokenizer(model).decode
    assert matched in decode(kept, skip_special_tokens=True)
    assert matched not in decode(kept[:-1], skip_special_tokens=True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    by_client = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0, stop=stop,
                                          extra_body={"ignore_eos": True})
    assert by_client.choices[0].text == text[:text.find(stop)]
    never = completion(server.url, prompt="hello", max_tokens=16, temperature=0, ignore_eos=True, stop=["#"])
    assert never["choices"][0]["text"] == text and never["choices"][0]["finish_reason"] == "length"
    too_many = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "stop": ["a"] * 17}, timeout=60)
    assert too_many.status_code == 400 and "stop" in too_many.json()["error"]["message"]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, model):
    answer = completion(server.url, prompt=[PROMPT], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    sequence = PROMPT + choice["token_ids"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(sequence) == len(logprobs["token_logprobs"])
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], hf_logprobs(model, sequence), atol=1e-4)
    # The generated token is greedy: its log-prob is exactly its top entry (lm-eval's is_greedy test).
    assert logprobs["token_logprobs"][-1] == max(logprobs["top_logprobs"][-1].values())
    assert choice["text"] == _tokenizer(model).decode(PROMPT) + _tokenizer(model).decode(choice["token_ids"],
                                                                                         skip_special_tokens=True)
    without_echo = completion(server.url, prompt=[PROMPT], max_tokens=4, temperature=0, logprobs=2)["choices"][0]
    native = httpx.post(server.url + "/generate", timeout=60, json={
        "input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert without_echo["token_ids"] == native["output_ids"]
    sampler = [p[0] for p in native["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(without_echo["logprobs"]["token_logprobs"], sampler, atol=1e-4)
    assert all(len(top) == 2 for top in without_echo["logprobs"]["top_logprobs"])


def test_chat_completions_through_the_openai_client_apply_the_chat_template(server, model):
    import openai
    import transformers

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    rendered = transformers.AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "s= be brief u= hi there a= "
    same = completion(server.url, prompt=rendered, max_tokens=8, temperature=0)["choices"][0]
    assert choice.message.content == same["text"] and chat.usage.prompt_tokens == len(rendered)
    tokens = choice.logprobs.content
    assert len(tokens) == chat.usage.completion_tokens
    for token in tokens:
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.logprob == token.top_logprobs[0].logprob  # greedy: the likeliest token was taken
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)


def test_the_requests_lm_eval_local_completions_sends(server, model):
    """The bodies lm-eval 0.4's `local-completions` model posts (tokenized prompts), and what it reads back."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    pairs = [(tokenizer("what is 1+1?").input_ids, tokenizer(" 2", add_special_tokens=False).input_ids),
             (tokenizer("and 2+2?").input_ids, tokenizer(" 4 it is", add_special_tokens=False).input_ids)]
    # loglikelihood: echo each whole sequence, one new token, read the continuation's log-probs and greediness.
    out = completion(server.url, model=model, prompt=[c + x for c, x in pairs], temperature=0, max_tokens=1,
                     logprobs=1, seed=1234, echo=True)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for choice, (context, continuation) in zip(choices, pairs):
        token_logprobs = choice["logprobs"]["token_logprobs"][len(context):-1]
        tops = choice["logprobs"]["top_logprobs"][len(context):-1]
        assert len(token_logprobs) == len(continuation) == len(tops)
        assert all(isinstance(lp, float) and lp <= max(top.values()) for lp, top in zip(token_logprobs, tops))
    context, continuation = pairs[1]
    expected = hf_logprobs(model, context + continuation)[len(context) - 1:]
    np.testing.assert_allclose(choices[1]["logprobs"]["token_logprobs"][len(context):-1], expected, atol=1e-4)
    # generate_until: stop strings from the task's `until`, the text read from choices[i].text.
    contexts = [context for context, _ in pairs]
    gen = completion(server.url, model=model, prompt=contexts, max_tokens=12, temperature=0, stop=["?", "\n\n"],
                     seed=1234)
    assert [c["index"] for c in gen["choices"]] == [0, 1]
    full = completion(server.url, model=model, prompt=contexts, max_tokens=12, temperature=0, seed=1234)
    for cut, whole in zip(gen["choices"], full["choices"]):
        assert cut["text"] == whole["text"].split("?")[0]  # cut before the first stop string, if any


LM_EVAL_TASK = """task: tiny_sums
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}="
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["?"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


LM_EVAL_CHOICE_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}="
doc_to_choice: "{{{{[answer, '9']}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""


@pytest.mark.slow  # lm_eval imports torch, datasets and evaluate: ~1 minute on 2 cores
def test_lm_eval_local_completions_runs_against_the_service(server, model, tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": str(2 * a)}) + "\n" for a in range(4)))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_sums.yaml").write_text(LM_EVAL_TASK.format(data=data))  # generate_until: stop
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(LM_EVAL_CHOICE_TASK.format(data=data))  # echo + logprobs
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model=tiny,base_url={server.url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
               "num_concurrent=1,max_retries=1", "--tasks", "tiny_sums,tiny_choice",
               "--include_path", str(tmp_path / "tasks"),
               "--output_path", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (results_file,) = [os.path.join(root, f) for root, _, files in os.walk(tmp_path / "out") for f in files
                       if f.startswith("results")]
    with open(results_file) as f:
        report = json.load(f)
    assert 0.0 <= report["results"]["tiny_sums"]["exact_match,none"] <= 1.0  # generated, cut at the stop string
    assert 0.0 <= report["results"]["tiny_choice"]["acc,none"] <= 1.0  # from the echoed prompt's log-probs
    assert report["n-samples"]["tiny_choice"]["effective"] == 4


def _documented_example(name: str) -> str:
    """The python block under the heading `## {name}` of docs/service.md."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "service.md")) as f:
        page = f.read()
    section = page.split(f"## {name}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_openai_client_example_runs_whole_and_streamed(server):
    """docs/service.md's example as written (its address this server's): the whole reply and the streamed one are the
    same greedy text."""
    import contextlib
    import io

    code = _documented_example("The `openai` client").replace("http://127.0.0.1:30000", server.url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/service.md", "exec"), {})
    whole, streamed = printed.getvalue().split("\n")[:2]
    assert whole and whole == streamed, printed.getvalue()


def test_completions_stream_through_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, n=2)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(m.text for m in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
