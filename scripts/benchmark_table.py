"""The README's benchmark table, generated from the newest committed record of each benchmark.

    python scripts/benchmark_table.py                 # print the Markdown table
    python scripts/benchmark_table.py --write README.md   # replace the table between its markers

Each row leads with the same-run ratio against the peer, then the absolute figures, then where
the record came from (date, commit, load). Records are written by `benchmarks/record.py`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- benchmark-table:begin -->", "<!-- benchmark-table:end -->"


def _train_step(r: dict) -> tuple[str, str]:
    what = f"SmolLM2-135M train step (fwd+bwd+AdamW), {r['batch']} tokens, float32, vs torch"
    ratio = f"**{r['jax_over_torch']:.2f}x** torch" if "jax_over_torch" in r else "-"
    return what, (f"{ratio}: {r['jax_tokens_per_s']:.0f} vs {r.get('torch_tokens_per_s', 0):.0f} tok/s; "
                  f"{r['jax_utilisation']:.0%} of the measured f32 matmul peak ({r['matmul_peak_gflops']:.0f} GFLOP/s)")


def _sampler(r: dict) -> tuple[str, str]:
    what = f"SmolLM2 sampler, batch {r['batch']}, {r['new_tokens']} new tokens, T=1, vs transformers `generate`"
    parts = []
    for dtype in ("float32", "bfloat16"):
        ours, theirs = r.get(f"ours_{dtype}"), r.get(f"transformers_{dtype}")
        if ours and theirs:
            parts.append(f"{dtype}: **{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x** same dtype "
                         f"({ours['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f} tok/s)")
    return what, "; ".join(parts) or "-"


def _long_context(r: dict) -> tuple[str, str]:
    what = "SmolLM2 long context: train step (blockwise + remat) vs torch, peak RSS; sampler vs transformers"
    parts = []
    for entry in r.get("train", []):
        ours, theirs = entry["ours"], entry["torch"]
        if "speedup" in entry:
            parts.append(f"{entry['batch']}: **{entry['speedup']:.2f}x** torch tok/s at {entry['memory_ratio']:.2f}x "
                         f"its memory ({ours['peak_rss_gb']:.1f} vs {theirs['peak_rss_gb']:.1f} GB)")
        elif "error" not in ours:
            parts.append(f"{entry['batch']}: {ours['tokens_per_s']:.0f} tok/s, {ours['peak_rss_gb']:.1f} GB "
                         "(torch failed)")
    sampler = r.get("sampler", {})
    if "speedup" in sampler:
        ours, theirs = sampler["ours"], sampler["transformers"]
        parts.append(f"sampler {sampler['prompts']}x{sampler['new_tokens']} {sampler['dtype']}: "
                     f"**{sampler['speedup']:.2f}x** ({ours['tokens_per_s']:.0f} vs "
                     f"{theirs['tokens_per_s']:.0f} tok/s)")
    return what, "; ".join(parts) or "-"


FORMATS: dict[str, Callable[[dict], tuple[str, str]]] = {"train_step": _train_step, "sampler": _sampler,
                                                            "long_context": _long_context}


def newest_records() -> dict[str, dict]:
    """script name -> its newest record (by the record's date)."""
    newest: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        record["file"] = path.relative_to(ROOT).as_posix()
        script = record["script"]
        if script not in newest or record["date"] > newest[script]["date"]:
            newest[script] = record
    return newest


def table(records: dict[str, dict]) -> str:
    rows = ["| benchmark | same-run ratio, then absolute figures | record |", "|---|---|---|"]
    for script, format_row in FORMATS.items():
        if script not in records:
            continue
        record = records[script]
        what, figures = format_row(record["results"][-1])
        m = record["machine"]
        source = (f"[{record['date'][:10]}]({record['file']}), {record['commit'][:7]}"
                  f"{' (dirty tree)' if record['dirty'] else ''}, {m['nproc']} cores, load "
                  f"{record['load_before']} -> {record['load_after']}")
        rows.append(f"| {what} | {figures} | {source} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="MARKDOWN", help="replace the table between its markers in this file")
    args = parser.parse_args(argv)
    text = table(newest_records())
    if not args.write:
        print(text)
        return 0
    path = pathlib.Path(args.write)
    document = path.read_text()
    if BEGIN not in document or END not in document:
        print(f"benchmark_table.py: {path} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = document.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
