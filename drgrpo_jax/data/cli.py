"""`python -m drgrpo_jax.data prepare NAME OUT.jsonl [--source HUB_ID_OR_FILE] [--subset S] [--split S]`.

`prepare` writes a public math set as the problem/answer JSONL the configs read (data.path, data.eval_path, evaluate
--suite).
"""

from __future__ import annotations

import argparse
import os
import sys

from drgrpo_jax.data.prepare import RECIPES, prepare_rows
from drgrpo_jax.data.sources import read_rows
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import hub_id
from drgrpo_jax.jsonl import check_output_file, write_jsonl

__all__ = ["PROG", "main"]

PROG = "python -m drgrpo_jax.data"
_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}  # a local --source file, by its extension


def _source_format(source: str) -> str:
    """How read_rows reads a local --source: a JSONL or Parquet file, or an HF dataset folder (a Hub id: any)."""
    if os.path.isdir(source) or not os.path.exists(source):
        return "hf_datasets"
    extension = os.path.splitext(source)[1].lower()
    if extension not in _FORMATS:
        raise ConfigError("--source", f"{source}: a local file must be .jsonl or .parquet (or give an HF dataset "
                                      "folder or a Hub dataset id)")
    return _FORMATS[extension]


def prepare(name: str, output: str, source: str | None, subset: str | None, split: str | None, limit: int) -> str:
    """Writes `output` (a new or regular file, replaced whole); returns the line that says what was written."""
    try:
        check_output_file(output)  # before the source is read: a device, FIFO or link is never replaced
    except ValueError as error:
        raise ConfigError("OUT.jsonl", str(error)) from None
    recipe = RECIPES[name]
    source = source or recipe.hub_id
    hub = None if os.path.exists(source) else hub_id(source)
    if subset is None:  # the recipe's subset for its own dataset at any revision; a copy's only one otherwise
        subset = recipe.subset if hub is not None and hub.repo_id == recipe.hub_id else ""
    split = split or recipe.split
    keys = ("--source", "--split", "--subset")
    rows = read_rows(source, _source_format(source), subset=subset, split=split, keys=keys)
    if limit:
        rows = rows[:limit]
    prepared = prepare_rows(recipe, rows)
    if not prepared.rows:
        raise ConfigError("--source", f"{source} gave no row with an answer ({len(rows)} rows read)")
    try:
        write_jsonl(prepared.rows, output)
    except ValueError as error:  # the output became a link or a device while the source was read
        raise ConfigError("OUT.jsonl", str(error)) from None
    left_out = prepared.without_answer + prepared.unparsable
    note = (f"; left out {left_out} ({prepared.without_answer} without an answer, {prepared.unparsable} that "
            "math_verify cannot parse)") if left_out else ""
    where = f"{source}" + (f" [{subset}]" if subset else "") + (f" split {split}" if not os.path.isfile(source) else "")
    return f"wrote {len(prepared.rows)} problems to {output} from {where}{note}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = "\n".join(f"  {name:8s} {r.hub_id} ({r.split}): {r.about}" for name, r in RECIPES.items())
    sub = commands.add_parser("prepare", help="write a public math set as problem/answer JSONL",
                              description="Write a public math set as problem/answer JSONL (one object a line).",
                              epilog=f"datasets (default source and split):\n{listing}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("name", choices=list(RECIPES), help="the dataset: " + ", ".join(RECIPES))
    sub.add_argument("output", metavar="OUT.jsonl", help="the JSONL file to write (its folder is created)")
    sub.add_argument("--source", metavar="HUB_ID_OR_FILE",
                     help="where to read it: a Hub dataset id org/name[@revision] (fetched into the HF cache), a "
                          "local .jsonl/.parquet file or HF dataset folder in the same schema (default: the "
                          "dataset's Hub id)")
    sub.add_argument("--subset", help="the source's configuration (default: the dataset's, e.g. main for gsm8k)")
    sub.add_argument("--split", help="the split to read (default: the dataset's: train for math12k, test for "
                                     "math500 and gsm8k, train for aime24)")
    sub.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N rows (0 = all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The CLI: a bad source, subset or split exits 2 with one line on stderr."""
    args = parse_args(argv)
    try:
        if args.limit < 0:
            raise ConfigError("--limit", f"must be >= 0, got {args.limit}")
        print(prepare(args.name, args.output, args.source, args.subset, args.split, args.limit), file=sys.stderr)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the output cannot be written
        print(f"{PROG}: error: {args.output}: {error.strerror or error}", file=sys.stderr)
        return 2
    return 0
