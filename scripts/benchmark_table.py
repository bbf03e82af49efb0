"""The benchmark tables of docs/benchmarks.md and the README's quickstart curve, generated from the committed records.

    python scripts/benchmark_table.py            # print the tables
    python scripts/benchmark_table.py --write    # replace the generated blocks of README.md and docs/benchmarks.md
    python scripts/benchmark_table.py --write FILE.md ...   # of these files only

Each row leads with the same-run ratio against the peer, then the absolute figures, then where
the record came from (date, commit, load). Records are written by `benchmarks/record.py`; they name the config
path of their day, shown here as it is now (configs/quickstarts/, configs/recipes/).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- benchmark-table:begin -->", "<!-- benchmark-table:end -->"
CURVE_BEGIN, CURVE_END = "<!-- quickstart-curve:begin -->", "<!-- quickstart-curve:end -->"
DEFAULT_FILES = ("README.md", "docs/benchmarks.md")  # where the generated blocks live
README_CONFIG = "configs/quickstart.yaml"  # README command 1's job: its row comes first


def _is_readme_job(result: dict) -> bool:
    """A quickstart result of README command 1: its config, no overrides, taken since records name the dtype
    `auto` resolved to (before, `auto` was float32 on every CPU: those runs are float32 rows now)."""
    return result.get("config") == README_CONFIG and not result.get("overrides") and "compute_dtype" in result


_DTYPE_OVERRIDE = "model.compute_dtype="


def _quickstart_dtype(result: dict) -> str:
    """The GEMM dtype of a quickstart run: recorded, else its override, else float32 (`auto` on CPUs then)."""
    asked = [o[len(_DTYPE_OVERRIDE):] for o in result.get("overrides", []) if o.startswith(_DTYPE_OVERRIDE)]
    return result.get("compute_dtype") or (asked[-1] if asked else "float32")


def _train_step(r: dict) -> tuple[str, str]:
    policy = {False: "none", True: "full"}.get(r.get("remat"), r.get("remat") or "none")  # older records: a bool
    remat = f", remat {policy}" if policy != "none" or "jax_over_torch" not in r else ""
    micro = f", {r['micro_batches']} micro-batches" if r.get("micro_batches", 1) > 1 else ""
    what = (f"SmolLM2-135M train step (fwd+bwd+AdamW), {r['batch']} tokens, {r.get('compute_dtype', 'float32')}"
            f"{remat}{micro}{', vs torch' if 'jax_over_torch' in r else ''}")
    if r.get("compute_dtype", "float32") == "float32":
        peak = f"{r['jax_utilisation']:.0%} of the measured f32 matmul peak ({r['matmul_peak_gflops']:.0f} GFLOP/s)"
    else:  # a bf16 step against the float32 peak would read as over 100%
        peak = f"{r['jax_gflops']:.0f} GFLOP/s achieved"
    if "peak_rss_gb" in r:  # one process ran both sides when there is a peer
        peak += f"; peak RSS {r['peak_rss_gb']:.1f} GB{' (both sides)' if 'jax_over_torch' in r else ''}"
    if r.get("jax_xla_memory_gb"):  # XLA's own account of our compiled step
        peak += f"; our step's XLA buffers: state {r['jax_xla_memory_gb']['arguments']:.2f} GB, temporaries " \
                f"{r['jax_xla_memory_gb']['temp']:.2f} GB"
    if "jax_over_torch" not in r:
        return what, f"{r['jax_tokens_per_s']:.0f} tok/s (no peer in this run); {peak}"
    return what, (f"**{r['jax_over_torch']:.2f}x** torch: {r['jax_tokens_per_s']:.0f} vs {r['torch_tokens_per_s']:.0f} "
                  f"tok/s; {peak}")


def _sampler(r: dict) -> tuple[str, str]:
    what = f"SmolLM2 sampler, batch {r['batch']}, {r['new_tokens']} new tokens, T=1, vs transformers `generate`"
    parts = []
    for dtype in ("float32", "bfloat16"):
        ours, theirs = r.get(f"ours_{dtype}"), r.get(f"transformers_{dtype}")
        if ours and theirs:
            parts.append(f"{dtype}: **{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x** same dtype "
                         f"({ours['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f} tok/s)")
    return what, "; ".join(parts) or "-"


def current_config(path: str) -> str:
    """A config path as a record names it, moved to where the file is now (configs/quickstarts/ or
    configs/recipes/) when only that exists; otherwise unchanged (records are history)."""
    if (ROOT / path).exists():
        return path
    name = pathlib.PurePosixPath(path).name
    moved = [f"configs/{folder}/{name}" for folder in ("quickstarts", "recipes")
             if (ROOT / "configs" / folder / name).exists()]
    return moved[0] if moved else path


def _quickstart(r: dict) -> tuple[str, str]:
    command = f"`{current_config(r['config'])}`{' ' + ' '.join(r['overrides']) if r['overrides'] else ''}"
    dtype = _quickstart_dtype(r) + (" (`auto` here)" if "compute_dtype" in r and not r["overrides"] else "")
    what = f"README command 1 ({command})" if _is_readme_job(r) else command
    what += f", {dtype}, whole job"
    phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s_median_after_first"].items() if v is not None)
    rewards, accuracy = r["reward_mean_by_step"], r["eval_accuracy_by_step"]
    greedy = (f"greedy accuracy at steps {'/'.join(accuracy)}: {'/'.join(f'{v:.2f}' for v in accuracy.values())}; "
              if accuracy else "")  # a config without an eval set
    trainer = f" (trainer process {r['trainer_peak_rss_gb']:.1f} GB)" if r.get("trainer_peak_rss_gb") else ""
    return what, (f"{r['wall_s'] / 60:.1f} min for {r['steps']} steps; a step after the first "
                  f"{r['step_s_median_after_first']:.1f} s ({phases}); reward {rewards[0]:.2f} -> {rewards[-1]:.2f}; "
                  f"{greedy}peak RSS {r['peak_rss_gb']:.1f} GB{trainer}")


def _long_context(r: dict) -> tuple[str, str]:
    gpu = r.get("device") == "gpu"
    memory = "peak_device_gb" if gpu else "peak_rss_gb"
    train = r.get("train", [])  # what the steps ran, as recorded (records before 2026-12-04 forced blockwise)
    attention = "/".join(sorted({e["ours"].get("attention", "blockwise") for e in train if "error" not in e["ours"]}))
    remat = "/".join(sorted({str(e.get("remat", "on")) for e in train}))
    what = (f"SmolLM2{' shape, random weights,' if 'random' in r.get('model', '') else ''} long context"
            f"{' on a GPU' if gpu else ''}: train step ({r.get('train_dtype', 'float32')}, {attention} attention, "
            f"remat {remat}) vs torch, {'peak GPU memory' if gpu else 'peak RSS'}; sampler vs transformers")
    parts = []
    for entry in r.get("train", []):
        ours, theirs = entry["ours"], entry["torch"]
        if "speedup" in entry:
            parts.append(f"{entry['batch']}: **{entry['speedup']:.2f}x** torch tok/s at {entry['memory_ratio']:.2f}x "
                         f"its memory ({ours[memory]:.1f} vs {theirs[memory]:.1f} GB)")
        elif "error" not in ours:
            parts.append(f"{entry['batch']}: {ours['tokens_per_s']:.0f} tok/s, {ours[memory]:.1f} GB "
                         "(torch failed)")
    sampler = r.get("sampler", {})
    if "speedup" in sampler:
        ours, theirs = sampler["ours"], sampler["transformers"]
        parts.append(f"sampler {sampler['prompts']}x{sampler['new_tokens']} {sampler['dtype']}: "
                     f"**{sampler['speedup']:.2f}x** ({ours['tokens_per_s']:.0f} vs "
                     f"{theirs['tokens_per_s']:.0f} tok/s)")
    return what, "; ".join(parts) or "-"


def _rl_step(r: dict) -> tuple[str, str]:
    what = (f"Dr.GRPO RL step, {r['prompts']} prompts x {r['group']} samples x {r['budget']} tokens (all generated), "
            "vs TRL `GRPOTrainer` (dr_grpo), each side in its own process")
    parts = []
    for dtype in ("float32", "bfloat16"):
        ours, theirs, ratio = r.get(f"ours_{dtype}"), r.get(f"trl_{dtype}"), r.get(f"speedup_{dtype}")
        if ours and theirs and ratio:
            parts.append(f"{dtype}: **{ratio['step']:.2f}x** TRL ({ours['seconds']['step']:.1f} vs "
                         f"{theirs['seconds']['step']:.1f} s/step; generate {ratio['generate']:.2f}x, update "
                         f"{ratio['update']:.2f}x; peak RSS {ours['peak_rss_gb']:.1f} vs "
                         f"{theirs['peak_rss_gb']:.1f} GB)")
    levers = [f"{key.split('_', 2)[2]} {value['step']:.2f}x" for key, value in r.items()
              if key.startswith("lever_") and "step" in value]
    if levers:  # each lever's step time over the default run's, ours only
        parts.append("our step time with one lever changed, over the default: " + ", ".join(levers))
    return what, "; ".join(parts) or "-"


def _attention(r: dict) -> tuple[str, str]:
    Q, C, H = r["heads_QCH"]
    what = (f"Causal self-attention alone, forward+backward, {r['dtype']}, {r['rows']} rows, {Q} query / {C} kv "
            f"heads of {H}: our blockwise kernel vs PyTorch SDPA")
    peer = {e["S"]: e["fwd_bwd_s"] for e in r["results"] if e["impl"] == "torch_sdpa"}
    parts = [f"S={e['S']}: **{e['speedup_vs_torch_sdpa']:.2f}x** ({e['fwd_bwd_s']:.3f} vs {peer[e['S']]:.3f} s, "
             f"XLA temporaries {e['temp_gb']:.2f} GB)" for e in r["results"]
             if e["impl"] == "blockwise" and "speedup_vs_torch_sdpa" in e]
    return what, "; ".join(parts) or "-"


def _rollout_engines(r: dict) -> tuple[str, str]:
    what = (f"The quickstart's rollout and weight push over {r['steps']} steps: the trainer's own service vs vLLM's "
            "CPU server (`rollout.engine=vllm`) on the same folder, one run after the other")
    ours, vllm = r["ours"], r["vllm_cpu"]
    return what, (f"vLLM's rollout seconds **{_vllm_over_ours(r):.2f}x** ours ({vllm['rollout_s']:.2f} vs "
                  f"{ours['rollout_s']:.2f} s/step), its push **{vllm['push_s'] / ours['push_s']:.2f}x** "
                  f"({vllm['push_s']:.2f} vs {ours['push_s']:.2f} s); vLLM starts in {r['vllm_start_s']:.0f} s")


def _vllm_over_ours(r: dict) -> float:
    return r["vllm_cpu"]["rollout_s"] / r["ours"]["rollout_s"]


def _staleness(r: dict) -> tuple[str, str]:
    what = (f"The quickstart over {r['steps']} steps, synchronous vs `rollout.async` K steps off (`kK`) and with "
            "`rollout.inflight_updates` (`kK_inflight`), one run after the other")
    sync = r["sync"]
    parts = [f"{mode}: **{r[f'speedup_{mode}']:.2f}x** synchronous ({r[mode]['step_seconds']:.1f} vs "
             f"{sync['step_seconds']:.1f} s/step, mean reward {statistics.mean(r[mode]['reward']):.3f} vs "
             f"{statistics.mean(sync['reward']):.3f})" for mode in r if mode.startswith("k")]
    return what, "; ".join(parts) or "-"


def _moe_upcycle(r: dict) -> tuple[str, str]:
    what = (f"SmolLM2-135M upcycled into {r['experts']} experts (top {r['top_k']}, fresh router), trained on the "
            f"quickstart's task for {r['steps']} steps")
    first, last = (r[f"expert_loads_{at}"]["expert_max_share"] for at in ("first", "last"))
    shares = [statistics.mean(first.values()), statistics.mean(last.values())]
    shifted = statistics.mean(abs(last[layer] - first[layer]) for layer in first)
    rewards, apart = r["reward_mean_by_step"], r.get("expert_divergence")
    moved = "" if apart is None else (f"; the experts, copies at step 0, apart by {apart['spread']:.2e} of their norm "
                                      f"(moved {apart['drift']:.2e} from the copy)")
    return what, (f"reward per step {' '.join(f'{v:.2f}' for v in rewards)}{moved}; the busiest expert's share of "
                  f"a layer's tokens {shares[0]:.3f} -> {shares[1]:.3f} (mean over layers; {1 / r['experts']:.2f} "
                  f"balanced), each layer's moved by {shifted:.3f} on average; "
                  f"{r['step_s_median_after_first']:.0f} s/step")


def _router_replay_mismatch(r: dict) -> tuple[str, str]:
    what = (f"Behaviour vs trainer log-probs of {r['completions']} sampled completions: a {r['model']} "
            f"({r['layers']} layers, {r['experts']} experts, top {r['experts_per_token']}), service in {r['dtype']}, "
            "trainer in float32, with and without router replay")
    replay, plain = r["replay"], r["no_replay"]
    return what, (f"largest gap without replay **{plain['logprob_absdiff_max'] / replay['logprob_absdiff_max']:.1f}x**"
                  f" with it ({plain['logprob_absdiff_max']:.4f} vs {replay['logprob_absdiff_max']:.4f}; mean "
                  f"{plain['logprob_absdiff_mean']:.5f} vs {replay['logprob_absdiff_mean']:.5f}); without, "
                  f"{100 * plain['routing_differs_token_share']:.2f}% of tokens routed differently")


def _context_parallel(r: dict) -> tuple[str, str]:
    runs, timed = r["runs"], "tokens_per_second" in r["runs"][0]
    what = (f"One row of {r['tokens']:,} tokens through the training step of a SmolLM2-135M-shaped model (float32, "
            f"remat {r['remat']}), its tokens split over `mesh.context` ways of 8 CPU devices (XLA's "
            "`memory_analysis()`)" + ("; tokens/s, the devices sharing the host's cores" if timed else ""))
    shares = ", ".join(f"{run['temp_share_of_first']:.2f}x at {run['context']}" for run in runs[1:])
    figures = (f"temporaries per device {shares} of context 1's ({runs[0]['temp_gb']:.2f} -> "
               f"{runs[-1]['temp_gb']:.2f} GB); the plan's per-device total "
               f"{min(run['planned_over_compiled'] for run in runs):.2f}-"
               f"{max(run['planned_over_compiled'] for run in runs):.2f}x the compiled one")
    if "baseline" in r:
        base = r["baseline"]
        figures += (f"; at {runs[-1]['context']} ways {runs[-1]['total_gb']:.2f} GB per device against "
                    f"{base['total_gb']:.2f} GB for 1 x {base['tokens']:,} tokens at context 1")
    if timed:
        figures += "; tokens/s " + ", ".join(f"{run['tokens_per_second_over_first']:.2f}x at {run['context']}"
                                             for run in runs[1:]) + " of context 1's"
    return what, figures


def _serving_limits(r: dict) -> tuple[str, str]:
    scoring, swaps = r["scoring_past_deadline"], r["swaps"]
    settings, taught = r["settings"], "scoring_learning" in r  # later records: one prompt, n rows, after a request
    rows = (f"one prompt x {settings['score_rows']}" if taught else str(settings["score_rows"]))  # taught the speed
    what = (f"The service on {settings['model']}: {len(swaps)} weight pushes of {r['weights_gb']:.2f} GB while "
            f"idle, and a scoring request ({rows} x {settings['score_tokens']:,} tokens, `echo` + `logprobs`) "
            f"against a {settings['deadline_s']:g} s deadline{' once the service knows its scoring speed' * taught}")
    return what, (f"a push's peak memory above the memory before it **{r['swap_peak_in_weights_median']:.2f}x** the "
                  f"weights' bytes (median; {min(s['peak_over_before_gb'] for s in swaps):.2f}-"
                  f"{max(s['peak_over_before_gb'] for s in swaps):.2f} GB); the scoring request answered in "
                  f"{scoring['answered_s']:.1f} s, then **{scoring['cpu_s_after_answer']:.0f} CPU s** of its work "
                  f"(the service busy {scoring['busy_s_after_answer']:.0f} s more, to the second)")


def _prefix_cache(r: dict) -> tuple[str, str]:
    s = r["settings"]
    what = (f"{s['requests']} requests of {s['n']} samples, each a shared {s['prefix_tokens']}-token prefix and its "
            f"own {s['tail_tokens']}-token tail, {s['new_tokens']} new tokens, one after another: the service's "
            "prefix cache on vs off, same run")
    on, off = r["cache_on"], r["cache_off"]
    return what, (f"seconds per request **{r['seconds_ratio_on_off']:.2f}x** with the cache "
                  f"({on['seconds_per_request']:.2f} vs {off['seconds_per_request']:.2f} s), prompt tokens prefilled "
                  f"**{r['prefill_ratio_on_off']:.2f}x** ({on['prefill_tokens_per_request']:.0f} vs "
                  f"{off['prefill_tokens_per_request']:.0f} per request)")


def _prefix_cache_quickstart(r: dict) -> tuple[str, str]:
    what = (f"`{r['config']}` for {r['steps']} steps on the trainer's own service, its prefix cache on vs off, one "
            "run after the other")
    seconds = r["rollout_s_median_after_first"]
    return what, (f"rollout seconds per step **{r['rollout_ratio_on_off']:.2f}x** with the cache "
                  f"({seconds['on']:.2f} vs {seconds['off']:.2f} s), prompt tokens prefilled "
                  f"**{r['prefill_ratio_on_off']:.2f}x** (mean share per step)")


def _admission(r: dict) -> tuple[str, str]:
    s, over = r["settings"], r["continuous_over"]
    what = (f"{s['requests']} one-row requests arriving every {s['gap_s']:g} s, 9 in 10 of {s['short_tokens']} new "
            f"tokens and 1 in 10 of {s['long_tokens']:,}, at most {s['batch']} rows at once: continuous admission "
            "vs static" + (" and vs vLLM's CPU server" if r.get("vllm_cpu") else "") + ", same run")
    parts = [f"{name}: throughput **{over[f'{key}_tokens_per_second_ratio']:.2f}x**, p50 latency "
             f"{over[f'{key}_p50_ratio']:.2f}x, p95 **{over[f'{key}_p95_ratio']:.2f}x**"
             for key, name in (("static", "against static"), ("vllm", "against vLLM")) if f"{key}_p95_ratio" in over]
    c = r["continuous"]
    return what, "; ".join(parts) + (f" (continuous: {c['tokens_per_second']:.0f} tokens/s, p50 "
                                     f"{c['p50_latency_s']:.1f} s, p95 {c['p95_latency_s']:.1f} s)")


FORMATS: dict[str, Callable[[dict], tuple[str, str]]] = {
    "quickstart": _quickstart, "rl_step": _rl_step, "train_step": _train_step, "sampler": _sampler,
    "long_context": _long_context, "attention": _attention, "rollout_engines": _rollout_engines,
    "staleness": _staleness, "moe_upcycle": _moe_upcycle, "router_replay_mismatch": _router_replay_mismatch,
    "context_parallel": _context_parallel, "prefix_cache": _prefix_cache,
    "prefix_cache_quickstart": _prefix_cache_quickstart, "admission": _admission, "serving_limits": _serving_limits}


# The headline figure of each script, (what it is, how to read it, unit): the spread over reproductions is shown on it.
RATIOS: dict[str, tuple[str, Callable[[dict], float | None], str]] = {
    "train_step": ("ratio", lambda r: r.get("jax_over_torch"), "x"),
    "sampler": ("float32 ratio", lambda r: r.get("ratio_float32"), "x"),
    "quickstart": ("step seconds", lambda r: r.get("step_s_median_after_first"), " s"),
    "rollout_engines": ("vLLM/ours rollout ratio", _vllm_over_ours, "x"),
    "staleness": ("K = 2 speedup", lambda r: r.get("speedup_k2"), "x"),
    "prefix_cache": ("seconds ratio", lambda r: r.get("seconds_ratio_on_off"), "x"),
    "prefix_cache_quickstart": ("rollout ratio", lambda r: r.get("rollout_ratio_on_off"), "x"),
    "serving_limits": ("CPU s past the deadline", lambda r: r["scoring_past_deadline"]["cpu_s_after_answer"], " s"),
    "admission": ("p50 ratio against static", lambda r: r["continuous_over"].get("static_p50_ratio"), "x")}


# What a figure depends on: commits that changed only other files (records, the README, this table) keep its code.
CODE_PATHS = ("drgrpo_jax", "benchmarks", ":!benchmarks/results", "configs", "pyproject.toml")


@functools.cache  # asked of every record by the sort and again by the grouping: one git call per commit
def _code_commit(commit: str) -> str:
    """The last commit at or before `commit` that changed the code its figures depend on (itself if git cannot
    say): a record committed before its reproduction was taken, or a README edit between them, must not split the
    two."""
    found = subprocess.run(["git", "log", "-1", "--format=%H", commit, "--", *CODE_PATHS],
                           cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    return found or commit


# The result fields that tell rows of one script apart (a config, a shape, a lever).
VARIANT_FIELDS = {"train_step": ("batch", "remat", "compute_dtype", "micro_batches"), "long_context": ("train_dtype",),
                  "attention": ("dtype", "rows"), "rollout_engines": ("steps",), "staleness": ("steps",),
                  "moe_upcycle": ("experts", "top_k"), "router_replay_mismatch": ("dtype",),
                  "context_parallel": ("tokens",), "prefix_cache_quickstart": ("config", "steps")}


def machine_kind(machine: dict) -> str:
    """The GPU a record ran on (nvidia-smi's name), else the CPU's matmul class from the flags `benchmarks/record.py`
    keeps: what decides the speed of each dtype (and what `model.compute_dtype: auto` picks), so records of
    different kinds are different rows."""
    if machine.get("gpus"):
        return f"{len(machine['gpus'])}x {machine['gpus'][0].split(',')[0]}"
    flags = set(machine.get("cpu_flags", ()))
    for flag, kind in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return kind
    return "no AVX2"


def _row_key(record: dict) -> tuple[str, str]:
    """(script, variant): one row per CPU kind and, within it, per config, other overrides and GEMM dtype the
    quickstart ran (a dtype asked for and the same one resolved by `auto` share a row), per shape and lever of the
    train step."""
    result = record["results"][-1]
    kind = machine_kind(record["machine"])
    if record["script"] == "quickstart":
        others = [o for o in result.get("overrides", []) if not o.startswith(_DTYPE_OVERRIDE)]
        return "quickstart", f"{result['config']} {others} {_quickstart_dtype(result)} {kind}"
    fields = [str(result.get(f, "")) for f in VARIANT_FIELDS.get(record["script"], ())]
    return record["script"], " ".join([*fields, kind])


@functools.cache
def _commit_time(commit: str) -> int:
    """When `commit` was made (0 if git does not know it)."""
    found = subprocess.run(["git", "show", "-s", "--format=%ct", commit], cwd=ROOT, capture_output=True, text=True,
                           check=False).stdout.strip()
    return int(found) if found.isdigit() else 0


def newest_records() -> dict[tuple[str, str], list[dict]]:
    """(script, variant) -> its records of the newest code that has one, newest first (the others reproduce it).

    By code, then date: a record of older code taken later (the code before a change, measured beside it) does
    not replace the row of the code after it."""
    by_row: dict[tuple[str, str], list[dict]] = {}
    for record in all_records():
        by_row.setdefault(_row_key(record), []).append(record)
    newest = {}
    for key, records in by_row.items():
        records.sort(key=lambda r: (_commit_time(_code_commit(r["commit"])), r["date"]), reverse=True)
        code = _code_commit(records[0]["commit"])
        newest[key] = [r for r in records if _code_commit(r["commit"]) == code]
    return newest


def _spread(script: str, records: list[dict]) -> str:
    if script not in RATIOS:
        return ""
    label, read, unit = RATIOS[script]
    values = sorted(v for v in (read(r["results"][-1]) for r in records) if v is not None)
    if len(values) < 2:
        return ""
    return f"; {label} over {len(values)} runs of this code: {values[0]:.2f}{unit}-{values[-1]:.2f}{unit}"


def _source(record: dict, link: bool = True) -> str:
    """Where a record came from: its date (a link to the file, or the file's name where links to the repository
    do not resolve, as on the docs site), commit, cores, machine kind and load."""
    m = record["machine"]
    cited = (f"[{record['date'][:10]}]({record['file']})" if link
             else f"{record['date'][:10]} (`{pathlib.PurePosixPath(record['file']).stem}`)")
    return (f"{cited}, {record['commit'][:7]}{' (dirty tree)' if record['dirty'] else ''}, {m['nproc']} cores "
            f"{machine_kind(m)}, load {record['load_before']} -> {record['load_after']}")


TITLES = {"quickstart": "Whole training jobs (`benchmarks/quickstart.py`)",
          "rl_step": "One RL step against TRL (`benchmarks/rl_step.py`)",
          "train_step": "The train step against PyTorch (`benchmarks/train_step.py`)",
          "sampler": "The sampler against transformers `generate` (`benchmarks/sampler.py`)",
          "long_context": "Long context (`benchmarks/long_context.py`)",
          "attention": "Attention alone (`benchmarks/attention.py`)",
          "rollout_engines": "Our generation service against vLLM (`benchmarks/rollout_engines.py`)",
          "staleness": "Asynchronous training, K steps off (`benchmarks/staleness.py`)",
          "moe_upcycle": "A mixture of experts learning on a CPU (`benchmarks/moe_upcycle.py`)",
          "router_replay_mismatch": "Router replay (`benchmarks/router_replay_mismatch.py`)",
          "context_parallel": "Context parallelism's memory (`benchmarks/context_parallel.py`)",
          "prefix_cache": "The service's prefix cache (`benchmarks/prefix_cache.py`)",
          "prefix_cache_quickstart": "The prefix cache in training (`benchmarks/prefix_cache_quickstart.py`)",
          "admission": "Continuous admission (`benchmarks/admission.py`)",
          "serving_limits": "Serving limits (`benchmarks/serving_limits.py`)"}


def table(records: dict[tuple[str, str], list[dict]], scripts: tuple[str, ...] = tuple(FORMATS),
          link: bool = True) -> str:
    """One Markdown table of the newest records of `scripts`, citing each record by a link relative to the
    repository root (`link`) or by its name."""
    rows = ["| benchmark | same-run ratio, then absolute figures | record |", "|---|---|---|"]
    keys = sorted((key for key in records if key[0] in scripts),
                  key=lambda key: (list(FORMATS).index(key[0]),
                                   not _is_readme_job(records[key][0]["results"][-1]), key[1]))
    for script, variant in keys:
        record = records[script, variant][0]
        what, figures = FORMATS[script](record["results"][-1])
        figures += _spread(script, records[script, variant])
        rows.append(f"| {what} | {figures} | {_source(record, link)} |")
    return "\n".join(rows)


def tables(records: dict[tuple[str, str], list[dict]]) -> str:
    """docs/benchmarks.md's block: a titled table per benchmark script that has records, citing records by name
    (the docs site holds no records to link to)."""
    present = [script for script in FORMATS if any(key[0] == script for key in records)]
    return "\n\n".join(f"## {TITLES[script]}\n\n{table(records, (script,), link=False)}" for script in present)


def all_records() -> list[dict]:
    """Every committed record, each with its repository-relative `file`."""
    loaded = []
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        record["file"] = path.relative_to(ROOT).as_posix()
        loaded.append(record)
    return loaded


def quickstart_curve(records: list[dict]) -> str:
    """The README's expected curve: README command 1's newest record, step by step, and what the run took."""
    jobs = [r for r in records if r["script"] == "quickstart" and _is_readme_job(r["results"][-1])]
    if not jobs:
        raise SystemExit(f"benchmark_table.py: no record of README command 1 ({README_CONFIG}) in {RESULTS}")
    record = max(jobs, key=lambda r: r["date"])
    r = record["results"][-1]
    rewards, accuracy = r["reward_mean_by_step"], r["eval_accuracy_by_step"]
    steps = range(len(rewards) + 1)
    rows = ["| step | " + " | ".join(str(s) for s in steps) + " |", "|---" * (len(steps) + 1) + "|",
            "| training reward (mean of the step's samples) | - | " + " | ".join(f"{v:.2f}" for v in rewards) + " |",
            "| greedy accuracy on the held-out sums | "
            + " | ".join(f"{accuracy[str(s)]:.2f}" if str(s) in accuracy else "" for s in steps) + " |"]
    m = record["machine"]
    took = (f"The run took {r['wall_s'] / 60:.1f} min for {r['steps']} steps (a step after the first "
            f"{r['step_s_median_after_first']:.1f} s) with the trainer process at "
            f"{r.get('trainer_peak_rss_gb', r['peak_rss_gb']):.1f} GB peak memory (its generation service and reward "
            f"workers, processes of their own, not counted), on {m['nproc']} CPU cores with "
            f"{machine_kind(m)} in {r['compute_dtype']} ([the record]({record['file']})). One seed: read it as "
            "\"it learns\", not as exact figures.")
    return "\n".join(rows) + "\n\n" + took


def replace_block(document: str, begin: str, end: str, text: str) -> str:
    """`document` with the text between `begin` and `end` replaced by `text` (the markers kept)."""
    head, rest = document.split(begin, 1)
    return f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="MARKDOWN", nargs="*",
                        help=f"replace the generated blocks between their markers in these files (default: "
                             f"{' '.join(DEFAULT_FILES)})")
    args = parser.parse_args(argv)
    if args.write is None:
        print(tables(newest_records()))
        return 0
    blocks = {(BEGIN, END): lambda: tables(newest_records()),
              (CURVE_BEGIN, CURVE_END): lambda: quickstart_curve(all_records())}
    for name in args.write or [str(ROOT / f) for f in DEFAULT_FILES]:
        path = pathlib.Path(name)
        document = path.read_text()
        found = [(begin, end) for begin, end in blocks if begin in document and end in document]
        if not found:
            print(f"benchmark_table.py: {path} has none of the markers {[begin for begin, _ in blocks]}",
                  file=sys.stderr)
            return 2
        for begin, end in found:
            document = replace_block(document, begin, end, blocks[begin, end]())
        path.write_text(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
