"""Where examples come from: reasoning-gym tasks, local JSONL/Parquet files, HF datasets (a local folder or a Hub
dataset id `org/name[@revision]` with data.subset and data.split), each row turned into an `Example`.

A Hub id is read through `datasets`, whose Hub files land in the HF cache with its progress bars; offline
(HF_HUB_OFFLINE=1) or when the Hub cannot be reached, the cached snapshot is read instead, and an id that is not
cached is a one-line error naming the key and the `hf download` command (drgrpo_jax/hub_ids.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.data.answers import text_after
from drgrpo_jax.data.examples import Example, PromptDataset
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import HubId, check_hub_id, hub_id, offline, snapshot
from drgrpo_jax.jsonl import read_jsonl
from drgrpo_jax.seeds import shuffle_permutation

__all__ = ["DATA_KEYS", "Keys", "RowFields", "load_dataset", "read_rows", "row_examples", "source_name",
           "task_examples"]


def task_examples(task: str, options: Mapping[str, Any], size: int, seed: int,
                  keys: tuple[str, str] = ("data.task", "data.task_options")) -> list[Example]:
    """`size` problems of a reasoning-gym task generated with `seed`, ids `task/seed/index`; ConfigError naming
    `keys` (the config keys or flags of the task and its options) for an unknown task or a bad option."""
    # start-up: reasoning_gym costs ~1.5 s, paid only by runs and suites that generate problems.
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; known tasks: {', '.join(sorted(DATASETS)[:12])}, ..."
        raise ConfigError(keys[0], f"unknown reasoning-gym task {task!r}{hint}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **dict(options))
    except (TypeError, ValueError, AssertionError) as error:  # task configs assert on their own ranges
        raise ConfigError(keys[1], f"{task}: {error}") from None
    examples = []
    for index in range(size):
        entry = dataset[index]
        answer = entry.get("answer")
        examples.append(Example(f"{task}/{seed}/{index}", str(entry["question"]),
                                "" if answer is None else str(answer), entry))
    return examples


def _reasoning_gym(config: DataConfig, seed: int) -> PromptDataset:
    """Generates size + eval_size entries with one seed; the last eval_size are held out."""
    examples = task_examples(config.task, config.task_options, config.size + config.eval_size, seed)
    return PromptDataset(config.task, tuple(examples[: config.size]), tuple(examples[config.size :]))


# ---------------------------------------------------------------------------------------------
# Rows of a file, a local HF dataset or a Hub dataset
# ---------------------------------------------------------------------------------------------


# The config keys (or flags) errors name: the path, its split and its subset.
Keys = tuple[str, str, str]
DATA_KEYS: Keys = ("data.path", "data.split", "data.subset")


def _split_rows(target: str, revision: str | None, subset: str, split: str, keys: Keys) -> list[Mapping[str, Any]]:
    """The rows of one split of an HF dataset (a folder or a Hub id), the subset and split checked by name first."""
    import datasets  # start-up: ~1 s, paid only by runs that read HF datasets

    what = target if revision is None else f"{target}@{revision}"
    configs = datasets.get_dataset_config_names(target, revision=revision)
    if subset and subset not in configs:
        raise ConfigError(keys[2], f"{subset!r} is not a configuration of {what} (configurations: "
                                   f"{', '.join(configs)})")
    if not subset and len(configs) > 1 and "default" not in configs:
        raise ConfigError(keys[2], f"{what} has several configurations; name one: {', '.join(configs)}")
    splits = datasets.get_dataset_split_names(target, subset or None, revision=revision)
    if split not in splits:
        raise ConfigError(keys[1], f"{split!r} not in {what} (splits: {', '.join(splits)})")
    return list(datasets.load_dataset(target, name=subset or None, split=split, revision=revision))


def _local_hf_rows(path: str, subset: str, split: str, keys: Keys) -> list[Mapping[str, Any]]:
    """A save_to_disk folder, else a dataset folder (data files, or a Hub snapshot with its README configs)."""
    import datasets  # start-up: ~1 s, paid only by runs that read HF datasets

    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError:  # not a save_to_disk folder
        return _split_rows(path, None, subset, split, keys)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(keys[1], f"{split!r} not in {path} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return list(loaded)


def _hub_rows(hub: HubId, subset: str, split: str, keys: Keys) -> list[Mapping[str, Any]]:
    """A Hub dataset's split: through `datasets` online (only the files that split needs), else the cached snapshot."""
    from datasets.exceptions import DatasetNotFoundError  # start-up: as _split_rows

    check_hub_id(hub, keys[0])  # online too: `datasets` takes the revision as given
    if not offline():
        try:
            return _split_rows(hub.repo_id, hub.revision, subset, split, keys)
        except DatasetNotFoundError as error:
            raise ConfigError(keys[0], f"{hub}: {error}") from None
        except ConnectionError:  # the Hub cannot be reached: what the cache holds, or the not-cached error
            pass
    return _local_hf_rows(snapshot(hub, keys[0], repo_type="dataset"), subset, split, keys)


def read_rows(path: str, source: str, *, subset: str = "", split: str = "train",
              keys: Keys = DATA_KEYS) -> list[Mapping[str, Any]]:
    """All rows of a local JSONL file, Parquet file or HF dataset (`source`), or of a Hub dataset id's split.

    A local path that exists wins over a Hub id of the same spelling. `keys`: the config keys (or flags) of the
    path, the split and the subset, named by the errors; any file that cannot be read (a line that is not a JSON
    object, bytes that are not UTF-8, a corrupt Parquet file or dataset folder) is a one-line ConfigError on the path.
    """
    try:
        if os.path.exists(path):
            if source == "jsonl":
                return list(read_jsonl(path))  # its errors name the file and line
            if source == "parquet":
                import pyarrow.parquet as pq  # start-up: paid only by runs that read Parquet

                return pq.read_table(path).to_pylist()
            return _local_hf_rows(path, subset, split, keys)
        hub = hub_id(path)
        if hub is None:
            raise ConfigError(keys[0], f"no such file or folder {path!r} (nor a Hub dataset id org/name[@revision])")
        return _hub_rows(hub, subset, split, keys)
    except ConfigError:
        raise
    except ValueError as error:  # read_jsonl's, naming the file and line; pyarrow's ArrowInvalid
        raise ConfigError(keys[0], str(error) if source == "jsonl" else f"cannot read {path}: {error}") from None
    except (OSError, KeyError, RecursionError) as error:  # unreadable Parquet (ArrowIOError), a broken folder
        raise ConfigError(keys[0], f"cannot read {path}: {type(error).__name__}: {error}") from None


# ---------------------------------------------------------------------------------------------
# Rows -> Examples, the held-out split
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowFields:
    """Where a row holds its prompt and reference answer, and the config keys (or flags) that name them."""

    prompts: tuple[str, ...]  # the first of these a row holds is the prompt
    answer: str
    answer_after: str  # keep only the text after the last occurrence of this marker (GSM8K's ####); "" = all
    keys: tuple[str, str] = ("data.prompt_field", "data.answer_field")

    @classmethod
    def of(cls, config: DataConfig) -> RowFields:
        return cls((config.prompt_field,), config.answer_field, config.answer_after)


def row_examples(rows: Sequence[Mapping[str, Any]], name: str, fields: RowFields, where: str) -> list[Example]:
    """Rows -> Examples with ids `name/row`; a missing field is a ConfigError naming the field's key."""
    examples = []
    for index, row in enumerate(rows):
        missing = f"missing in row {index} of {where} (fields: {', '.join(row)})"
        prompt = next((field for field in fields.prompts if field in row), None)
        if prompt is None:
            raise ConfigError(fields.keys[0], f"{' or '.join(map(repr, fields.prompts))} {missing}")
        if fields.answer not in row:
            raise ConfigError(fields.keys[1], f"{fields.answer!r} {missing}")
        answer = text_after(str(row[fields.answer]), fields.answer_after)
        examples.append(Example(f"{name}/{index}", str(row[prompt]), answer))
    return examples


def source_name(path: str) -> str:
    """A dataset's short name: its file or folder name, or a Hub id's name."""
    return os.path.splitext(os.path.basename(os.path.normpath(path)))[0]


def _held_out(config: DataConfig) -> tuple[str, str, Keys] | None:
    """(path, split, their keys) of a separate held-out set, or None when it is held out of data.path's rows."""
    if not (config.eval_path or config.eval_split):
        return None
    path = config.eval_path or config.path
    path_key = "data.eval_path" if config.eval_path else "data.path"
    split_key = "data.eval_split" if config.eval_split else "data.split"
    if not config.eval_path and os.path.isfile(config.path):
        raise ConfigError("data.eval_split", f"{config.path} is one file without splits; set data.eval_path")
    return path, config.eval_split or config.split, (path_key, split_key, "data.subset")


def _from_files(config: DataConfig, seed: int) -> PromptDataset:
    """A seeded permutation of the rows: the first eval_size held out (unless a separate held-out set is named),
    then `size` to train."""
    name = source_name(config.path)
    rows = read_rows(config.path, config.source, subset=config.subset, split=config.split)
    examples = row_examples(rows, name, RowFields.of(config), config.path)
    order = shuffle_permutation(len(examples), seed)
    separate = _held_out(config)
    if separate is not None:
        path, split, keys = separate
        eval_rows = read_rows(path, config.source, subset=config.subset, split=split, keys=keys)
        held_out = row_examples(eval_rows, f"{source_name(path)}-eval", RowFields.of(config), path)
        held_out = held_out[: config.eval_size]
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
