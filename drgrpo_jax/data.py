"""Prompts and reference answers: reasoning-gym tasks, local JSONL/Parquet, local HF datasets.

The order of training prompts is a pure function of (dataset, position, batch size, seed), so
a run resumes exactly by saving one integer, the position (batches drawn so far).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.errors import ConfigError

__all__ = [
    "Example",
    "PromptDataset",
    "PromptStream",
    "batch_at",
    "load_dataset",
    "render_prompt",
    "tokenize_prompt",
]


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer."""

    prompt_id: str  # stable across runs and resumes: source name / row index in the source
    question: str
    answer: str
    entry: Mapping[str, Any] | None = None  # reasoning-gym's raw entry, for the task's own score_answer


@dataclasses.dataclass(frozen=True)
class PromptDataset:
    """A training split and a held-out evaluation split."""

    name: str
    train: tuple[Example, ...]
    eval: tuple[Example, ...]


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def _reasoning_gym(config: DataConfig, seed: int) -> PromptDataset:
    """Generates size + eval_size entries with one seed; the last eval_size are held out."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if config.task not in DATASETS:
        close = difflib.get_close_matches(config.task, list(DATASETS), n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; known tasks: {', '.join(sorted(DATASETS)[:12])}, ..."
        raise ConfigError("data.task", f"unknown reasoning-gym task {config.task!r}{hint}")
    total = config.size + config.eval_size
    try:
        dataset = reasoning_gym.create_dataset(config.task, size=total, seed=seed, **dict(config.task_options))
    except (TypeError, ValueError, AssertionError) as error:  # task configs assert on their own ranges
        raise ConfigError("data.task_options", f"{config.task}: {error}") from None
    examples = []
    for index in range(total):
        entry = dataset[index]
        answer = entry.get("answer")
        answer_text = "" if answer is None else str(answer)
        examples.append(Example(f"{config.task}/{seed}/{index}", str(entry["question"]), answer_text, entry))
    return PromptDataset(config.task, tuple(examples[: config.size]), tuple(examples[config.size :]))


def _read_rows(path: str, source: str, split: str) -> list[Mapping[str, Any]]:
    """All rows of a local JSONL file, Parquet file or Hugging Face dataset."""
    if source == "jsonl":
        rows = []
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise ConfigError("data.path", f"{path} line {number} is not JSON: {error}") from None
        return rows
    if source == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError:  # not a save_to_disk folder: a local dataset folder or the offline cache
        loaded = datasets.load_dataset(path, split=split)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError("data.split", f"{split!r} not in {path} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return list(loaded)


def _answer_text(value: Any, marker: str) -> str:
    """The reference answer as text, cut after the last `marker` when present (GSM8K's '#### 42')."""
    text = str(value)
    if marker and marker in text:
        text = text.rsplit(marker, 1)[1]
    return text.strip()


def _examples(rows: Sequence[Mapping[str, Any]], name: str, config: DataConfig, key: str) -> list[Example]:
    """Rows -> Examples with ids `name/row`; a missing field is a ConfigError naming the field."""
    examples = []
    for index, row in enumerate(rows):
        fields = [("data.prompt_field", config.prompt_field), ("data.answer_field", config.answer_field)]
        for field_key, field in fields:
            if field not in row:
                raise ConfigError(field_key, f"{field!r} missing in row {index} of {key} (fields: {', '.join(row)})")
        answer = _answer_text(row[config.answer_field], config.answer_after)
        examples.append(Example(f"{name}/{index}", str(row[config.prompt_field]), answer))
    return examples


def _from_files(config: DataConfig, seed: int) -> PromptDataset:
    """A seeded permutation of the rows: the first eval_size held out (unless eval_path), then `size` to train."""
    if not os.path.exists(config.path):
        raise ConfigError("data.path", f"no such file or folder {config.path!r}")
    name = os.path.splitext(os.path.basename(os.path.normpath(config.path)))[0]
    examples = _examples(_read_rows(config.path, config.source, config.split), name, config, "data.path")
    order = np.random.default_rng(seed).permutation(len(examples))
    if config.eval_path:
        if not os.path.exists(config.eval_path):
            raise ConfigError("data.eval_path", f"no such file or folder {config.eval_path!r}")
        eval_name = os.path.splitext(os.path.basename(os.path.normpath(config.eval_path)))[0]
        eval_rows = _read_rows(config.eval_path, config.source, config.split)
        held_out = _examples(eval_rows, f"{eval_name}-eval", config, "data.eval_path")[: config.eval_size]
        train_order = order
    else:
        held_out = [examples[i] for i in order[: config.eval_size]]
        train_order = order[config.eval_size :]
    if config.size:
        train_order = train_order[: config.size]
    train = tuple(examples[i] for i in sorted(train_order))  # file order; batch_at does the shuffling
    if not train:
        raise ConfigError(
            "data.path", f"{config.path} has {len(examples)} rows, none left for training after data.eval_size"
        )
    return PromptDataset(name, train, tuple(held_out))


def load_dataset(config: DataConfig, seed: int) -> PromptDataset:
    """The configured dataset with its held-out split; raises ConfigError on a bad source."""
    if config.source == "reasoning_gym":
        return _reasoning_gym(config, seed)
    return _from_files(config, seed)


# ---------------------------------------------------------------------------------------------
# Order: a pure function of the position
# ---------------------------------------------------------------------------------------------


def _epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation used in `epoch` (each epoch reshuffled, reproducibly)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_at(dataset: PromptDataset, position: int, batch_size: int, seed: int) -> tuple[Example, ...]:
    """The `position`-th batch of training prompts (0-based); epochs wrap with a fresh shuffle."""
    if position < 0 or batch_size < 1:
        raise ValueError(f"batch_at: position must be >= 0 and batch_size >= 1, got {position}, {batch_size}")
    num = len(dataset.train)
    batch = []
    cache: dict[int, np.ndarray] = {}
    for k in range(position * batch_size, (position + 1) * batch_size):
        epoch, offset = divmod(k, num)
        if epoch not in cache:
            cache[epoch] = _epoch_order(num, seed, epoch)
        batch.append(dataset.train[int(cache[epoch][offset])])
    return tuple(batch)


class PromptStream:
    """An iterator over `batch_at` whose whole state is one int (save it with the checkpoint)."""

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, position: int = 0):
        self.dataset, self.batch_size, self.seed, self.position = dataset, batch_size, seed, position

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> tuple[Example, ...]:
        batch = batch_at(self.dataset, self.position, self.batch_size, self.seed)
        self.position += 1
        return batch

    def state(self) -> int:
        """Batches drawn so far."""
        return self.position

    def restore(self, state: int) -> None:
        """Continue as if `state` batches had been drawn."""
        if isinstance(state, bool) or not isinstance(state, int) or state < 0:
            raise ValueError(f"PromptStream.restore: state must be a non-negative int, got {state!r}")
        self.position = state


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(example: Example, config: DataConfig, tokenizer: Any = None) -> str:
    """The prompt text: the template, inside the tokenizer's chat template when it has one and it is on."""
    # str.replace, not str.format: templates hold LaTeX braces such as \boxed{}.
    user = config.template.replace("{question}", example.question)
    if config.use_chat_template and tokenizer is not None and _has_chat_template(tokenizer):
        messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{config.system_prompt}\n\n{user}" if config.system_prompt else user


def tokenize_prompt(example: Example, config: DataConfig, tokenizer: Any) -> list[int]:
    """Prompt token ids; a chat template already holds its special tokens, so none are added again."""
    text = render_prompt(example, config, tokenizer)
    chat = config.use_chat_template and _has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])
