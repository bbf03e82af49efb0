"""Benchmark records: what record.py stores with a figure, and the tables and curve built from the records."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.subprocess  # record.py runs the benchmark command and git


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_record_holds_the_figures_and_where_they_came_from(tmp_path, monkeypatch):
    record = _load("benchmarks/record.py")
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    line = {"benchmark": "train_step", "jax_tokens_per_s": 100.0}
    command = [sys.executable, "-c", f"print('warming up'); print({json.dumps(json.dumps(line))})"]
    assert record.main(["--max-load", "1e9", "--", *command]) == 0
    [path] = tmp_path.glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["results"] == [line]
    assert len(saved["commit"]) == 40 and isinstance(saved["dirty"], bool)
    assert saved["machine"]["nproc"] >= 1 and saved["machine"]["cpu_model"]
    assert {"date", "command", "load_before", "load_after"} <= saved.keys()
    assert record.main(["--max-load", "0", "--", *command]) == 2  # a busy machine is refused
    assert record.main(["--max-load", "1e9", "--", sys.executable, "-c", "print('no json')"]) == 1


def test_the_table_leads_with_the_same_run_ratio_and_cites_the_record(tmp_path, monkeypatch):
    table = _load("scripts/benchmark_table.py")
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    monkeypatch.setattr(table, "ROOT", tmp_path)
    result = {"batch": "16x192", "jax_over_torch": 0.9, "jax_tokens_per_s": 124.0, "torch_tokens_per_s": 141.0,
              "jax_utilisation": 0.55, "matmul_peak_gflops": 190.0}
    monkeypatch.setattr(table, "_commit_time", lambda commit: {"a": 200, "b": 100}[commit[0]])  # b is older code
    runs = [("2026-12-01T00:00:00+00:00", "a", 0.9), ("2026-11-30T00:00:00+00:00", "a", 0.8),
            ("2026-11-01T00:00:00+00:00", "b", 5.0),
            ("2026-12-02T00:00:00+00:00", "b", 7.0)]  # the older code measured later, beside the newer
    for date, commit, ratio in runs:
        record = {"script": "train_step", "date": date, "commit": commit * 40, "dirty": False, "load_before": 0.2,
                  "load_after": 1.1, "machine": {"nproc": 2}, "results": [dict(result, jax_over_torch=ratio)]}
        (tmp_path / f"train_step-{date[:10]}.json").write_text(json.dumps(record))
    text = table.table(table.newest_records())
    assert "**0.90x** torch: 124 vs 141 tok/s" in text and "5.00x" not in text and "7.00x" not in text  # newest code
    assert "ratio over 2 runs of this code: 0.80x-0.90x" in text  # its reproduction, not older code
    assert "2026-12-01" in text and "load 0.2 -> 1.1" in text
    page = tmp_path / "benchmarks.md"
    page.write_text(f"before\n{table.BEGIN}\nold\n{table.END}\nafter\n")
    assert table.main(["--write", str(page)]) == 0
    tables = table.tables(table.newest_records())
    cited_by_name = text.replace("[2026-12-01](train_step-2026-12-01.json)", "2026-12-01 (`train_step-2026-12-01`)")
    assert tables == f"## {table.TITLES['train_step']}\n\n{cited_by_name}"  # the docs site has no records to link
    assert page.read_text() == f"before\n{table.BEGIN}\n{tables}\n{table.END}\nafter\n"
    page.write_text("no markers")
    assert table.main(["--write", str(page)]) == 2


def test_each_machine_kind_keeps_its_own_row(tmp_path, monkeypatch):
    """A record from another CPU kind (which decides each dtype's speed and what `auto` picks) or from a GPU adds a
    row naming its kind instead of replacing the row of the kind measured before."""
    table = _load("scripts/benchmark_table.py")
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    monkeypatch.setattr(table, "ROOT", tmp_path)
    result = {"batch": "32x128", "jax_over_torch": 1.0, "jax_tokens_per_s": 100.0, "torch_tokens_per_s": 100.0,
              "jax_utilisation": 0.5, "matmul_peak_gflops": 200.0}
    kinds = {"amx": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "zen4": ["avx2", "avx512f", "avx512_bf16"],
             "avx2": ["avx2"], "gpu": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}
    for day, (name, flags) in enumerate(kinds.items(), start=1):
        machine = {"nproc": 2, "cpu_flags": flags, **({"gpus": ["NVIDIA H200, 143771 MiB, 580.1"]} if name == "gpu"
                                                      else {})}
        record = {"script": "train_step", "date": f"2026-12-0{day}T00:00:00+00:00", "commit": "a" * 40,
                  "dirty": False, "load_before": 0.2, "load_after": 1.1, "machine": machine,
                  "results": [dict(result, jax_over_torch=float(day))]}
        (tmp_path / f"train_step-{name}.json").write_text(json.dumps(record))
    rows = table.table(table.newest_records()).splitlines()[2:]
    assert len(rows) == 4
    expected = [("1.00x", "AMX-BF16"), ("2.00x", "AVX512-BF16"), ("3.00x", "AVX2"), ("4.00x", "1x NVIDIA H200")]
    for ratio, kind in expected:
        [row] = [row for row in rows if f"**{ratio}**" in row]
        assert f"2 cores {kind}, load" in row
    assert table.machine_kind({"cpu_flags": []}) == "no AVX2"


def test_long_context_series_row_and_failed_worker():
    """benchmarks/long_context.py's memory series and README row, and a worker that fails is reported, not raised."""
    long_context, table = _load("benchmarks/long_context.py"), _load("scripts/benchmark_table.py")
    train = [{"batch": f"{rows}x{length}", "tokens": rows * length,
              "ours": {"tokens_per_s": 50.0, "peak_rss_gb": gb}, "torch": {"tokens_per_s": 40.0, "peak_rss_gb": 9.0},
              "speedup": 1.25, "memory_ratio": round(gb / 9.0, 3)}
             for rows, length, gb in [(1, 8192, 6.0), (2, 2048, 3.0), (1, 4096, 3.0)]]
    series = long_context.memory_series(train + [{"batch": "1x16384", "tokens": 16384, "ours": {"error": "oom"}}])
    assert series["batches"] == ["1x4096", "2x2048", "1x8192"] and series["ours_peak_rss_gb"] == [3.0, 3.0, 6.0]
    fit = series["fit_gb_per_1k_tokens"], series["fit_intercept_gb"], series["fit_max_residual_gb"]
    assert fit == (0.75, 0.0, 0.0)
    sampler = {"prompts": 16, "new_tokens": 1024, "dtype": "float32", "speedup": 2.5,
               "ours": {"tokens_per_s": 250.0}, "transformers": {"tokens_per_s": 100.0}}
    _, row = table.FORMATS["long_context"]({"train": train[1:2], "sampler": sampler})
    assert row == ("2x2048: **1.25x** torch tok/s at 0.33x its memory (3.0 vs 9.0 GB); "
                   "sampler 16x1024 float32: **2.50x** (250 vs 100 tok/s)")
    on_gpu = [{**e, "ours": {**e["ours"], "peak_device_gb": 1.5, "attention": "cudnn"}, "remat": "none",
               "torch": {**e["torch"], "peak_device_gb": 3.0}, "memory_ratio": 0.5} for e in train]
    assert long_context.memory_series(on_gpu, "peak_device_gb")["ours_peak_device_gb"] == [1.5, 1.5, 1.5]
    what, row = table.FORMATS["long_context"]({"train": on_gpu[1:2], "device": "gpu", "model": "... random weights"})
    assert "on a GPU" in what and "random weights" in what and "peak GPU memory" in what
    assert "(float32, cudnn attention, remat none)" in what  # what the record says the step ran
    assert row == "2x2048: **1.25x** torch tok/s at 0.50x its memory (1.5 vs 3.0 GB)"
    failed = long_context.run_worker("no_such_worker", {}, timeout_s=120)
    assert failed["error"].startswith("exit 1: KeyError")


def test_attention_ratio_against_torch_sdpa_and_its_row(monkeypatch):
    """benchmarks/attention.py: each of our rows of a length gets torch's seconds over ours; the row shows them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports its _common as a sibling
    attention, table = _load("benchmarks/attention.py"), _load("scripts/benchmark_table.py")
    results = attention.with_ratios([
        {"impl": "blockwise", "S": 2048, "fwd_bwd_s": 0.6, "temp_gb": 0.03, "block": 128},
        {"impl": "reference", "S": 8192, "fwd_bwd_s": 9.0, "temp_gb": 4.85},  # no peer at this length
        {"impl": "torch_sdpa", "S": 2048, "fwd_bwd_s": 0.3, "torch_threads": 2}])
    assert [r.get("speedup_vs_torch_sdpa") for r in results] == [0.5, None, None]
    _, row = table.FORMATS["attention"]({"heads_QCH": [9, 3, 64], "rows": 2, "dtype": "float32", "results": results})
    assert row == "S=2048: **0.50x** (0.600 vs 0.300 s, XLA temporaries 0.03 GB)"


def test_one_quickstart_row_per_config_and_the_rl_step_row(tmp_path, monkeypatch):
    table = _load("scripts/benchmark_table.py")
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    monkeypatch.setattr(table, "ROOT", tmp_path)
    quickstart = {"overrides": [], "wall_s": 450.0, "steps": 10, "step_s_median_after_first": 31.3,
                  "phases_s_median_after_first": {"rollout": 7.5, "train": 22.2}, "reward_mean_by_step": [0.2, 0.3],
                  "eval_accuracy_by_step": {"0": 0.47, "10": 0.59}, "peak_rss_gb": 9.5}
    runs = [("01", "configs/lora_quickstart.yaml", [], {}),  # taken before records named the dtype: float32
            ("02", "configs/quickstart.yaml", [], {}),
            ("03", "configs/quickstart.yaml", ["model.compute_dtype=bfloat16"], {}),
            ("04", "configs/quickstart.yaml", [], {"compute_dtype": "bfloat16"})]  # auto resolved it
    for day, config, overrides, dtype in runs:
        record = {"script": "quickstart", "date": f"2026-12-{day}T00:00:00+00:00", "commit": day * 20,
                  "dirty": False, "load_before": 0.2, "load_after": 1.1, "machine": {"nproc": 2},
                  "results": [dict(quickstart, config=config, overrides=overrides, **dtype)]}
        (tmp_path / f"quickstart-{day}.json").write_text(json.dumps(record))
    text = table.table(table.newest_records())
    # README command 1's comes first; the bfloat16 asked for shares its row (the newer record shows); the older
    # float32 run of its config and the LoRA config keep theirs
    assert [row.split(",")[0] for row in text.splitlines()[2:]] == \
        ["| README command 1 (`configs/quickstart.yaml`)", "| `configs/lora_quickstart.yaml`",
         "| `configs/quickstart.yaml`"]
    readme_row, lora_row, float32_row = text.splitlines()[2:]
    assert "bfloat16 (`auto` here), whole job" in readme_row and "[2026-12-04]" in readme_row
    assert lora_row.startswith("| `configs/lora_quickstart.yaml`, float32, whole job")
    assert float32_row.startswith("| `configs/quickstart.yaml`, float32, whole job")
    side = {"seconds": {"step": 20.0, "generate": 5.0, "update": 15.0}, "peak_rss_gb": 3.0}
    _, row = table.FORMATS["rl_step"]({"prompts": 8, "group": 4, "budget": 64, "ours_float32": side,
                                       "trl_float32": dict(side, seconds={"step": 30.0}),
                                       "speedup_float32": {"step": 1.5, "generate": 2.0, "update": 1.2}})
    assert row.startswith("float32: **1.50x** TRL (20.0 vs 30.0 s/step; generate 2.00x, update 1.20x")


def test_the_engine_staleness_and_mixture_rows_lead_with_their_ratios():
    table = _load("scripts/benchmark_table.py")
    _, row = table.FORMATS["rollout_engines"]({"steps": 6, "vllm_start_s": 75.1,
                                               "ours": {"rollout_s": 2.0, "push_s": 0.8},
                                               "vllm_cpu": {"rollout_s": 3.5, "push_s": 1.2}})
    assert row == "vLLM's rollout seconds **1.75x** ours (3.50 vs 2.00 s/step), its push **1.50x** (1.20 vs 0.80 s); " \
                  "vLLM starts in 75 s"
    _, row = table.FORMATS["staleness"]({"steps": 6, "sync": {"step_seconds": 30.0, "reward": [0.1, 0.3]},
                                         "k2": {"step_seconds": 20.0, "reward": [0.2, 0.2]}, "speedup_k2": 1.5})
    assert row == "k2: **1.50x** synchronous (20.0 vs 30.0 s/step, mean reward 0.200 vs 0.200)"
    loads = {"expert_max_share": {"0": 0.25, "1": 0.35}}
    _, row = table.FORMATS["moe_upcycle"]({"experts": 4, "top_k": 2, "steps": 2, "reward_mean_by_step": [0.1, 0.4],
                                           "expert_loads_first": loads, "step_s_median_after_first": 120.4,
                                           "expert_loads_last": {"expert_max_share": {"0": 0.5, "1": 0.6}},
                                           "expert_divergence": {"drift": 0.0004, "spread": 0.0005}})
    assert row.startswith("reward per step 0.10 0.40; the experts, copies at step 0, apart by 5.00e-04 of their "
                          "norm (moved 4.00e-04 from the copy); the busiest expert's share of a layer's tokens "
                          "0.300 -> 0.550 (mean over layers; 0.25 balanced), each layer's moved by 0.250 on average")
    _, row = table.FORMATS["router_replay_mismatch"]({
        "completions": 32, "model": "random qwen3_moe", "layers": 4, "experts": 8, "experts_per_token": 2,
        "dtype": "bfloat16", "replay": {"logprob_absdiff_max": 0.005, "logprob_absdiff_mean": 0.001},
        "no_replay": {"logprob_absdiff_max": 0.04, "logprob_absdiff_mean": 0.002, "routing_differs_token_share": 0.02}})
    assert row.startswith("largest gap without replay **8.0x** with it (0.0400 vs 0.0050")

def test_expert_divergence_is_zero_for_the_upcycled_copies_and_measures_each_expert(tmp_path):
    """moe_upcycle's drift and spread against numpy on a tiny upcycled Mixtral whose expert 0 alone moves."""
    from drgrpo_jax.models.hf_io import save_pretrained
    from drgrpo_jax.models.pretrained import from_pretrained
    from drgrpo_jax.models.upcycle import upcycle

    from support.tiny_models import write_tiny_llama

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        divergence = _load("benchmarks/moe_upcycle.py").expert_divergence
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    mixture = upcycle(from_pretrained(write_tiny_llama(str(tmp_path / "dense"))), 4, 2, seed=0)
    save_pretrained(mixture, str(tmp_path / "before"))
    assert divergence(str(tmp_path / "before"), str(tmp_path / "before")) == {"drift": 0.0, "spread": 0.0}
    for name in ("expert_gate", "expert_up", "expert_down"):  # [L, e, X, Y]: expert 0 of every layer, 10% more
        param = getattr(mixture.blocks, name)
        param[...] = param[...].at[:, 0].multiply(1.1)
    save_pretrained(mixture, str(tmp_path / "after"))
    # expert 0 moved by 0.1 of its norm, the others not: drift 0.1 / 4; pairs (0, j) apart by 0.1, the rest 0
    assert divergence(str(tmp_path / "before"), str(tmp_path / "after")) == pytest.approx(
        {"drift": 0.025, "spread": 0.05}, abs=1e-5)


def test_the_upcycle_summary_follows_the_loads_at_every_step():
    """moe_upcycle's per-step means over layers, from metrics rows (eval rows, without `loss`, left out)."""
    summarise = _load("benchmarks/moe_upcycle.py").summarise
    rows = [{"loss": 0.1, "step_seconds": 9.0, "reward_mean": 0.2, "expert_max_share/0": 0.3, "expert_max_share/1": 0.5,
             "expert_entropy/0": 1.2, "expert_entropy/1": 1.0},
            {"eval_accuracy": 0.5},
            {"loss": 0.1, "step_seconds": 2.0, "reward_mean": 0.4, "expert_max_share/0": 0.4, "expert_max_share/1": 0.6,
             "expert_entropy/0": 1.1, "expert_entropy/1": 0.9}]
    got = summarise(rows)
    assert got["steps"] == 2 and got["step_s_median_after_first"] == 2.0
    assert got["expert_max_share_mean_by_step"] == pytest.approx([0.4, 0.5])
    assert got["expert_entropy_mean_by_step"] == pytest.approx([1.1, 1.0])
    assert got["expert_loads_last"]["expert_max_share"] == {"0": 0.4, "1": 0.6}


def test_the_readme_curve_is_the_newest_record_of_command_1(tmp_path, monkeypatch):
    """The README's expected curve: README command 1's newest record (not a newer record of another config), every
    step's reward and the greedy accuracy where it was evaluated, and the record it came from."""
    table = _load("scripts/benchmark_table.py")
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    monkeypatch.setattr(table, "ROOT", tmp_path)
    result = {"config": "configs/quickstart.yaml", "overrides": [], "compute_dtype": "float32", "wall_s": 120.0,
              "steps": 2, "step_s_median_after_first": 50.0, "reward_mean_by_step": [0.25, 0.5],
              "eval_accuracy_by_step": {"0": 0.4, "2": 0.6}, "peak_rss_gb": 3.5, "trainer_peak_rss_gb": 2.5}
    runs = [("01", result), ("02", dict(result, reward_mean_by_step=[0.1, 0.9])),
            ("03", dict(result, config="configs/quickstarts/grpo_quickstart.yaml"))]
    for day, res in runs:
        record = {"script": "quickstart", "date": f"2026-12-{day}T00:00:00+00:00", "commit": day * 20, "dirty": False,
                  "load_before": 0.2, "load_after": 1.1, "machine": {"nproc": 2, "cpu_flags": ["avx2"]},
                  "results": [res]}
        (tmp_path / f"quickstart-{day}.json").write_text(json.dumps(record))
    curve = table.quickstart_curve(table.all_records()).splitlines()
    assert curve[0] == "| step | 0 | 1 | 2 |"
    assert curve[2] == "| training reward (mean of the step's samples) | - | 0.10 | 0.90 |"  # day 02's
    assert curve[3] == "| greedy accuracy on the held-out sums | 0.40 |  | 0.60 |"
    assert "2.0 min for 2 steps" in curve[5] and "2.5 GB" in curve[5] and "AVX2 in float32" in curve[5]
    assert "([the record](quickstart-02.json))" in curve[5]  # a link, no date in the README's text


def test_records_name_configs_where_they_are_now():
    """Records keep the config path of their day; the tables show where that config lives now."""
    table = _load("scripts/benchmark_table.py")
    assert table.current_config("configs/lora_quickstart.yaml") == "configs/quickstarts/lora_quickstart.yaml"
    assert table.current_config("configs/qwen2.5_math_7b_dr_grpo_v5p64.yaml") == \
        "configs/recipes/qwen2.5_math_7b_dr_grpo_v5p64.yaml"
    assert table.current_config("configs/quickstart.yaml") == "configs/quickstart.yaml"
    assert table.current_config("configs/gone.yaml") == "configs/gone.yaml"


RECORD_NAME = (r"\b(?:quickstart|rl_step|train_step|sampler|long_context|attention|rollout_engines|staleness"
               r"|moe_upcycle|router_replay_mismatch)-\d{8}T\d{6}Z\b")


def test_the_docs_state_what_the_committed_records_say():
    """Every record names a commit of this history (a record of code that never landed cannot be checked), every
    record the README, the docs pages and the configs cite is committed, and the generated blocks are what the
    records make (regenerate them with `python scripts/benchmark_table.py --write`)."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("needs the whole git history (a full clone)")
    table = _load("scripts/benchmark_table.py")
    history = set(subprocess.run(["git", "rev-list", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    orphans = [path.name for path in sorted(table.RESULTS.glob("*.json"))
               if json.loads(path.read_text())["commit"] not in history]
    assert not orphans, f"records of commits not in this branch's history: {orphans}"
    citing = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
              *sorted((ROOT / "configs").rglob("*.yaml")), *sorted((ROOT / "configs").rglob("*.md"))]
    cited = {name for path in citing for name in re.findall(RECORD_NAME, path.read_text())}
    assert cited and not [name for name in sorted(cited) if not (table.RESULTS / f"{name}.json").exists()]
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page.split(table.BEGIN, 1)[1].split(table.END, 1)[0].strip() == table.tables(table.newest_records())
    readme = (ROOT / "README.md").read_text()
    stated = readme.split(table.CURVE_BEGIN, 1)[1].split(table.CURVE_END, 1)[0].strip()
    assert stated == table.quickstart_curve(table.all_records())


def test_a_worker_reports_its_own_peak_memory_not_its_parents():
    """long_context's workers are started by a process that holds the exported model: a worker's peak RSS must
    be its own (Linux's ru_maxrss keeps the parent's peak across exec, which once floored every worker's figure)."""
    import numpy as np

    held = np.ones(768 * 2**20 // 8)  # this process: >= 0.75 GB resident
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import long_context; " \
           "print(long_context.peak_rss_gb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert held.sum() > 0 and child < 0.5, child


def test_a_quickstart_summary_carries_the_episodes_of_a_run_with_tools():
    summarise = _load("benchmarks/quickstart.py").summarise
    train = [{"step": s, "loss": 0.1, "step_seconds": 10.0 + s, "reward_mean": r, "episode/tool_calls": c,
              "episode/malformed_calls": 0.5 - c / 2, "episode/model_tokens": 40.0}
             for s, r, c in ((1, 0.25, 0.3), (2, 0.5, 0.6), (3, 0.875, 0.9))]
    evals = [{"step": 0, "eval/accuracy": 0.5, "eval/avg@2": 0.25}, {"step": 3, "eval/accuracy": 0.75,
                                                                     "eval/avg@2": 0.625}]
    summary = summarise([evals[0], *train, evals[1]])
    assert summary["reward_mean_by_step"] == [0.25, 0.5, 0.875] and summary["step_s_median_after_first"] == 12.5
    assert summary["tool_calls_by_step"] == [0.3, 0.6, 0.9] and summary["malformed_calls_by_step"] == [0.35, 0.2, 0.05]
    assert summary["eval_accuracy_by_step"] == {0: 0.5, 3: 0.75} and summary["avg@2_by_step"] == {0: 0.25, 3: 0.625}
    plain = summarise([{key: value for key, value in row.items() if not key.startswith("episode/")} for row in train])
    assert not [key for key in plain if key.startswith(("tool_calls", "malformed", "model_tokens", "avg@"))]


def test_the_context_cache_admission_and_limit_rows_lead_with_their_ratios():
    table = _load("scripts/benchmark_table.py")
    run = {"temp_gb": 4.0, "total_gb": 7.0, "planned_over_compiled": 1.0, "temp_share_of_first": 1.0,
           "tokens_per_second": 100.0, "tokens_per_second_over_first": 1.0}
    _, row = table.FORMATS["context_parallel"]({
        "tokens": 8192, "remat": "full", "baseline": {"tokens": 2048, "total_gb": 3.0},
        "runs": [{**run, "context": 1}, {**run, "context": 2, "temp_gb": 2.0, "total_gb": 5.0,
                                         "temp_share_of_first": 0.5, "planned_over_compiled": 0.9,
                                         "tokens_per_second_over_first": 0.8}]})
    assert row == ("temporaries per device 0.50x at 2 of context 1's (4.00 -> 2.00 GB); the plan's per-device total "
                   "0.90-1.00x the compiled one; at 2 ways 5.00 GB per device against 3.00 GB for 1 x 2,048 tokens at "
                   "context 1; tokens/s 0.80x at 2 of context 1's")
    _, row = table.FORMATS["prefix_cache"]({
        "settings": {"requests": 8, "n": 4, "prefix_tokens": 440, "tail_tokens": 40, "new_tokens": 64},
        "seconds_ratio_on_off": 0.5, "prefill_ratio_on_off": 0.25,
        "cache_on": {"seconds_per_request": 1.0, "prefill_tokens_per_request": 120.0},
        "cache_off": {"seconds_per_request": 2.0, "prefill_tokens_per_request": 480.0}})
    assert row == ("seconds per request **0.50x** with the cache (1.00 vs 2.00 s), prompt tokens prefilled **0.25x** "
                   "(120 vs 480 per request)")
    _, row = table.FORMATS["prefix_cache_quickstart"]({
        "config": "configs/tool_quickstart.yaml", "steps": 4, "rollout_ratio_on_off": 0.6, "prefill_ratio_on_off": 0.3,
        "rollout_s_median_after_first": {"on": 6.0, "off": 10.0}})
    assert row == "rollout seconds per step **0.60x** with the cache (6.00 vs 10.00 s), prompt tokens prefilled " \
                  "**0.30x** (mean share per step)"
    what, row = table.FORMATS["admission"]({
        "settings": {"requests": 40, "gap_s": 0.25, "short_tokens": 32, "long_tokens": 1024, "batch": 8},
        "continuous": {"tokens_per_second": 50.0, "p50_latency_s": 1.0, "p95_latency_s": 9.0}, "vllm_cpu": {"x": 1},
        "continuous_over": {"static_tokens_per_second_ratio": 1.5, "static_p50_ratio": 0.5, "static_p95_ratio": 0.9,
                            "vllm_tokens_per_second_ratio": 1.1, "vllm_p50_ratio": 0.8, "vllm_p95_ratio": 0.7}})
    assert "and vs vLLM's CPU server" in what
    assert row == ("against static: throughput **1.50x**, p50 latency 0.50x, p95 **0.90x**; against vLLM: throughput "
                   "**1.10x**, p50 latency 0.80x, p95 **0.70x** (continuous: 50 tokens/s, p50 1.0 s, p95 9.0 s)")
    _, row = table.FORMATS["serving_limits"]({
        "weights_gb": 0.5, "swap_peak_in_weights_median": 2.0, "settings": {"model": "m", "score_rows": 8,
                                                                           "score_tokens": 1000, "deadline_s": 2.0},
        "swaps": [{"peak_over_before_gb": 0.9}, {"peak_over_before_gb": 1.1}],
        "scoring_past_deadline": {"answered_s": 2.1, "busy_s_after_answer": 30.4, "cpu_s_after_answer": 55.0}})
    assert row == ("a push's peak memory above the memory before it **2.00x** the weights' bytes (median; 0.90-1.10 "
                   "GB); the scoring request answered in 2.1 s, then **55 CPU s** of its work (the service busy 30 s "
                   "more, to the second)")
