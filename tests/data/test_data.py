"""Datasets: reasoning-gym, JSONL, Parquet, HF datasets; held-out split; deterministic resumable order; prompts."""

import dataclasses
import json

import pytest

from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.data import sources
from drgrpo_jax.data.examples import Example, PromptDataset
from drgrpo_jax.data.order import PromptStream, batch_at
from drgrpo_jax.data.prompts import render_prompt, tokenize_prompt
from drgrpo_jax.data.sources import load_dataset
from drgrpo_jax.errors import ConfigError

ROWS = [{"problem": f"What is {i} + {i}?", "solution": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(20)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _file_config(path, source="jsonl", **kwargs) -> DataConfig:
    return DataConfig(
        source=source, path=str(path), prompt_field="problem", answer_field="solution", size=0, eval_size=5, **kwargs
    )


def _toy_dataset(num: int) -> PromptDataset:
    return PromptDataset("toy", tuple(Example(f"toy/{i}", f"q{i}", str(i)) for i in range(num)), ())


def test_reasoning_gym_is_seeded_and_keeps_entries():
    config = DataConfig(source="reasoning_gym", task="basic_arithmetic", size=12, eval_size=4)
    first, again, other = load_dataset(config, 3), load_dataset(config, 3), load_dataset(config, 4)
    assert (len(first.train), len(first.eval)) == (12, 4)
    assert [e.question for e in first.train] == [e.question for e in again.train]
    assert [e.question for e in first.train] != [e.question for e in other.train]
    held_out = {e.prompt_id for e in first.eval}
    assert held_out.isdisjoint(e.prompt_id for e in first.train)
    example = first.train[0]
    assert example.prompt_id == "basic_arithmetic/3/0"
    # The entry is kept so the reward side can call the task's own scorer.
    import reasoning_gym

    score = reasoning_gym.get_score_answer_fn(example.entry["metadata"]["source_dataset"])
    assert score(example.answer, example.entry) == 1.0


def test_reasoning_gym_task_options_and_errors():
    config = DataConfig(task="chain_sum", task_options={"min_terms": 2, "max_terms": 2}, size=4, eval_size=0)
    assert all(e.question.count("+") + e.question.count("-") >= 1 for e in load_dataset(config, 0).train)
    with pytest.raises(ConfigError) as info:
        load_dataset(DataConfig(task="basic_arithmetc"), 0)
    assert str(info.value).startswith("data.task: unknown reasoning-gym task")
    assert "did you mean basic_arithmetic?" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_dataset(DataConfig(task="chain_sum", task_options={"no_such_option": 1}, size=2), 0)
    assert str(info.value).startswith("data.task_options: chain_sum")


def test_jsonl_fields_answer_marker_and_held_out_split(tmp_path):
    dataset = load_dataset(_file_config(_write_jsonl(tmp_path / "gsm.jsonl", ROWS)), seed=0)
    assert dataset.name == "gsm" and (len(dataset.train), len(dataset.eval)) == (15, 5)
    ids = {e.prompt_id for e in dataset.train}
    assert ids.isdisjoint(e.prompt_id for e in dataset.eval) and len(ids | {e.prompt_id for e in dataset.eval}) == 20
    by_id = {e.prompt_id: e for e in dataset.train + dataset.eval}
    assert by_id["gsm/7"].question == "What is 7 + 7?" and by_id["gsm/7"].answer == "14"  # after '####'
    # Another seed holds out other rows; the ids stay the row indices.
    assert {e.prompt_id for e in load_dataset(_file_config(tmp_path / "gsm.jsonl"), seed=1).eval} != {
        e.prompt_id for e in dataset.eval
    }
    capped = load_dataset(dataclasses.replace(_file_config(tmp_path / "gsm.jsonl"), size=4), seed=0)
    assert len(capped.train) == 4


def test_a_jsonl_file_with_a_byte_order_mark_loads_as_without(tmp_path):
    plain = _write_jsonl(tmp_path / "gsm.jsonl", ROWS)
    marked = tmp_path / "marked" / "gsm.jsonl"
    marked.parent.mkdir()
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_dataset(_file_config(marked), seed=0) == load_dataset(_file_config(plain), seed=0)


def test_separate_eval_file(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _write_jsonl(tmp_path / "test.jsonl", ROWS[:3])
    config = dataclasses.replace(_file_config(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "test.jsonl"))
    dataset = load_dataset(config, seed=0)
    assert len(dataset.train) == 20
    assert [e.prompt_id for e in dataset.eval] == ["test-eval/0", "test-eval/1", "test-eval/2"]


def test_file_errors_name_the_field(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError) as info:
        load_dataset(dataclasses.replace(_file_config(path), prompt_field="question"), 0)
    assert str(info.value).startswith("data.prompt_field: 'question' missing in row 0") and "problem" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_dataset(_file_config(tmp_path / "missing.jsonl"), 0)
    assert str(info.value).startswith("data.path: no such file")
    (tmp_path / "bad.jsonl").write_text('{"problem": "x", "solution": "1"}\nnot json\n')
    with pytest.raises(ConfigError) as info:
        load_dataset(_file_config(tmp_path / "bad.jsonl"), 0)
    assert "line 2 is not JSON" in str(info.value) and "\n" not in str(info.value)


def test_parquet_and_hf_datasets_match_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    reference = load_dataset(_file_config(_write_jsonl(tmp_path / "d.jsonl", ROWS)), 0)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    from_parquet = load_dataset(_file_config(tmp_path / "d.parquet", source="parquet"), 0)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "d"))
    from_hf = load_dataset(_file_config(tmp_path / "d", source="hf_datasets"), 0)
    assert from_parquet == reference and from_hf == reference
    with pytest.raises(ConfigError) as info:
        load_dataset(dataclasses.replace(_file_config(tmp_path / "d", source="hf_datasets"), split="test"), 0)
    assert str(info.value).startswith("data.split: 'test' not in")


def test_batches_are_deterministic_and_cover_each_epoch():
    dataset = _toy_dataset(10)
    batches = [batch_at(dataset, p, 4, seed=1) for p in range(5)]  # 20 prompts = two epochs
    assert batches == [batch_at(dataset, p, 4, seed=1) for p in range(5)]
    flat = [e.prompt_id for batch in batches for e in batch]
    assert sorted(flat[:10]) == sorted(f"toy/{i}" for i in range(10)) == sorted(flat[10:])
    assert flat[:10] != flat[10:]  # each epoch reshuffled
    assert flat[:10] != [e.prompt_id for p in range(3) for e in batch_at(dataset, p, 4, seed=2)][:10]


def test_stream_resumes_exactly():
    dataset = _toy_dataset(7)
    uninterrupted = PromptStream(dataset, 3, seed=5)
    expected = [next(uninterrupted) for _ in range(6)]
    first = PromptStream(dataset, 3, seed=5)
    got = [next(first) for _ in range(2)]
    saved = first.state()
    assert saved == 2
    resumed = PromptStream(dataset, 3, seed=5)
    resumed.restore(json.loads(json.dumps(saved)))  # the state survives a JSON round trip
    got += [next(resumed) for _ in range(4)]
    assert got == expected
    with pytest.raises(ValueError, match="non-negative int"):
        resumed.restore(-1)


def _tiny_tokenizer(chat_template: str | None):
    """A word-level tokenizer built offline, optionally with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>",
             "What", "is", "2", "+", "?", "Answer", "Be", "brief"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


CHAT = (
    "<bos>{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_prompts_with_and_without_chat_template():
    example = Example("x/0", "What is 2 + 2 ?", "4")
    config = DataConfig(template="{question} Answer", system_prompt="Be brief")
    assert render_prompt(example, config) == "Be brief\n\nWhat is 2 + 2 ? Answer"
    chat = _tiny_tokenizer(CHAT)
    text = render_prompt(example, config, chat)
    assert text == "<bos><|system|> Be brief <|user|> What is 2 + 2 ? Answer <|assistant|>"
    ids = tokenize_prompt(example, config, chat)
    assert ids.count(0) == 1 and ids[0] == 0  # the template's <bos>, not a second one
    assert 1 not in ids  # no unknown words
    plain = _tiny_tokenizer(None)
    assert render_prompt(example, config, plain) == "Be brief\n\nWhat is 2 + 2 ? Answer"
    assert tokenize_prompt(example, config, plain)[0] == 0  # the tokenizer adds <bos> itself
    off = dataclasses.replace(config, use_chat_template=False)
    assert render_prompt(example, off, chat) == "Be brief\n\nWhat is 2 + 2 ? Answer"
    latex = DataConfig(template="{question}\nPut your final answer within \\boxed{}.")
    assert render_prompt(example, latex).endswith("\\boxed{}.")


@pytest.mark.parametrize("name, content, words", [
    ("row.jsonl", b'{"problem": "p", "solution": "1"}\n7\n', "line 2 is not a JSON object"),
    ("null.jsonl", b"null\n", "line 1 is not a JSON object"),
    ("deep.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1 is nested too deep"),
    ("latin1.jsonl", b'{"problem": "caf\xe9", "solution": "1"}\n', "line 1 is not UTF-8"),
    ("digits.jsonl", b'{"problem": "p", "solution": ' + b"7" * 5000 + b"}\n", "line 1 is not JSON"),
    ("corrupt.parquet", b"PAR1" + b"\0" * 64 + b"PAR1", "cannot read"),
])
def test_hostile_files_are_one_line_naming_the_file(tmp_path, name, content, words):
    """What the trainer's set-up reads before anything compiles: a ConfigError on data.path, never a traceback."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_dataset(_file_config(path, source=name.rsplit(".", 1)[1]), 0)
    message = str(info.value)
    assert message.startswith("data.path: ") and str(path) in message and words in message and "\n" not in message


def test_a_hub_dataset_revision_is_checked_before_datasets_sees_it_online(monkeypatch):
    called = []
    monkeypatch.setattr(sources, "offline", lambda: False)
    monkeypatch.setattr(sources, "_split_rows", lambda *args: called.append(args) or [])
    config = DataConfig(source="jsonl", path="org/set@refs/../../../outside")
    with pytest.raises(ConfigError, match="data.path"):
        load_dataset(config, 0)
    assert not called
