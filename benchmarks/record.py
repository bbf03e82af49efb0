"""Runs one benchmark command and commits-ready records what it printed, with the facts a reader needs.

    python benchmarks/record.py -- python benchmarks/train_step.py --rows 16

Writes benchmarks/results/<script>-<UTC time>.json: the JSON lines the command printed, the exact
command, the git commit (and whether the tree had uncommitted changes; or the one --commit names), the
date, `nproc`, the CPU model and its relevant flags, the GPUs `nvidia-smi` lists (if any), and the 1-minute
load average before and after. Refuses to start when the load is already >= --max-load (a busy machine halves
some figures), unless --force.
`scripts/benchmark_table.py --write` turns the records into docs/benchmarks.md's tables and the README's curve.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()


def _cpu() -> tuple[str, list[str]]:
    """(CPU model name, which of the flags that decide matmul speed it has)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", []
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown"), [f for f in _FLAGS if f in flags]


def _gpus() -> list[str]:
    """'name, memory, driver' of each NVIDIA GPU, as nvidia-smi lists them ([] without one)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def machine() -> dict[str, object]:
    model, flags = _cpu()
    found = {"nproc": os.cpu_count(), "cpu_model": model, "cpu_flags": flags, "platform": platform.platform(),
             "python": platform.python_version()}
    gpus = _gpus()
    return {**found, "gpus": gpus} if gpus else found


def json_lines(stdout: str) -> list[dict]:
    """Every line of the output that is a JSON object (the benchmarks print one each)."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-load", type=float, default=1.0, help="refuse to start above this 1-minute load")
    parser.add_argument("--force", action="store_true", help="record even on a busy machine (the record says so)")
    parser.add_argument("--note", default="", help="a free-text note stored with the record")
    parser.add_argument("--commit", default="",
                        help="the commit of a tree whose .git is missing or stale (a copy sent to a GPU machine); "
                             "the caller vouches that the tree is that commit, clean")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark command after --")
    load_before = os.getloadavg()[0]
    if load_before >= args.max_load and not args.force:
        print(f"record.py: load {load_before:.2f} >= {args.max_load}: wait for a quiet machine (or --force)",
              file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.UTC)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    sys.stderr.write(done.stderr[-4000:])
    results = json_lines(done.stdout)
    if done.returncode or not results:
        print(f"record.py: {shlex.join(command)} exited {done.returncode} with {len(results)} JSON lines",
              file=sys.stderr)
        return 1
    record = {
        "script": next((pathlib.Path(c).stem for c in command if c.endswith(".py")), pathlib.Path(command[0]).name),
        "command": shlex.join(command),
        "commit": args.commit or _git("rev-parse", "HEAD"),
        "dirty": False if args.commit else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "commit_given": bool(args.commit),
        "date": started.isoformat(timespec="seconds"),
        "seconds": round((datetime.datetime.now(datetime.UTC) - started).total_seconds(), 1),
        "machine": machine(),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "forced": args.force,
        "note": args.note,
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{record['script']}-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(results[-1]))
    print(f"record.py: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
