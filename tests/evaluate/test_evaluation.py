"""Evaluation without a service: a stand-in client, tokenizer and scorer; suites, reports and the CLI's checks."""

import json
import os

import numpy as np
import pytest

from drgrpo_jax.actor.actor import Actor
from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.data.sources import load_dataset
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.evaluate.evaluation import (
    EvalSamples,
    EvalSettings,
    eval_metrics,
    eval_summary,
    evaluate_problems,
    summarize,
)
from drgrpo_jax.evaluate.report import markdown_table, report_rows, write_report
from drgrpo_jax.evaluate.suites import load_suite
from drgrpo_jax.rewards.functions import RewardResult
from drgrpo_jax.rollout.client import Completions
from drgrpo_jax.seeds import prompt_seeds

BUDGET = 6


class StandInClient:
    """Answers /generate as a service would: each row's tokens depend only on its prompt's seed and sample index."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, group_size, *, max_new_tokens, temperature, top_p, stop_token_ids, seed,
                 expected_version, prompt_offset, **engine_options):
        self.calls.append({"prompts": len(prompts), "group": group_size, "temperature": temperature,
                           "offset": prompt_offset, "expected_version": expected_version})
        seeds = prompt_seeds(seed, len(prompts), prompt_offset)
        rows = len(prompts) * group_size
        ids = np.zeros((rows, max_new_tokens), np.int32)
        lengths = np.zeros(rows, np.int32)
        for p, prompt_seed in enumerate(seeds):
            for g in range(group_size):
                rng = np.random.default_rng([prompt_seed, g, int(temperature * 100)])
                n = int(rng.integers(1, max_new_tokens + 1))
                ids[p * group_size + g, :n] = rng.integers(3, 5, n)  # tokens 3 and 4
                lengths[p * group_size + g] = n
        mask = np.arange(max_new_tokens)[None, :] < lengths[:, None]
        return Completions(response_ids=ids, behaviour_logprobs=np.zeros(ids.shape, np.float32), response_mask=mask,
                           lengths=lengths, truncated=lengths == max_new_tokens, weight_versions=("0",) * rows,
                           token_versions=np.where(mask, 0, -1).astype(np.int32), group_size=group_size)

    def prefix_cache_delta(self):
        return None  # a service without a prefix cache


class StandInTokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join("x" if t == 3 else "y" for t in row) for row in rows]


class StandInScorer:
    """Correct when the completion starts with x; a second component that is never the correctness one."""

    def score(self, texts, examples, lengths, given=None):
        components = np.asarray([[float(t.startswith("x")), 0.5] for t in texts], np.float32)
        return RewardResult(components, ("math_verify", "format"), (1.0, 1.0), ("math_verify", "format"),
                            np.zeros(2, np.int64), np.zeros(2, np.int64))


EXAMPLES = tuple(Example(f"toy/{i}", f"q{i}", "a") for i in range(7))
PROMPTS = [[5, i] for i in range(7)]


def _run(chunk: int, samples: int = 4, greedy: bool = True):
    settings = EvalSettings(max_new_tokens=BUDGET, samples=samples, temperature=0.7, seed=11, chunk_prompts=chunk,
                            greedy=greedy)
    done = []
    client = StandInClient()
    out = evaluate_problems(Actor(client, StandInScorer(), StandInTokenizer()), EXAMPLES, PROMPTS, settings,
                            expected_version=3, progress=done.append)
    return out, client.calls, done


def test_samples_do_not_depend_on_the_chunk_size_and_progress_counts_problems():
    (greedy, sampled), calls, done = _run(chunk=7)
    assert greedy.correct_PG.shape == (7, 1) and sampled.correct_PG.shape == (7, 4)
    assert [c["temperature"] for c in calls] == [0.0, 0.7] and {c["expected_version"] for c in calls} == {3}
    for chunk in (1, 3):
        (greedy_c, sampled_c), calls_c, done_c = _run(chunk)
        assert greedy_c.texts == greedy.texts and sampled_c.texts == sampled.texts
        np.testing.assert_array_equal(sampled_c.correct_PG, sampled.correct_PG)
        assert [c["offset"] for c in calls_c if c["group"] == 4] == list(range(0, 7, chunk))
        assert sum(done_c) == 14 and len(done_c) == 2 * len(range(0, 7, chunk))
    # The correctness column decides, the format column's 0.5 does not; lengths and truncation are the sampler's.
    np.testing.assert_array_equal(sampled.correct_PG.ravel(), [t.startswith("x") for t in sampled.texts])
    np.testing.assert_array_equal(sampled.lengths_PG.ravel(), [len(t) for t in sampled.texts])
    np.testing.assert_allclose(sampled.reward_PG, sampled.correct_PG + 0.5)
    np.testing.assert_array_equal(sampled.truncated_PG, sampled.lengths_PG == BUDGET)


def test_summary_keys_values_and_the_trainer_row():
    (greedy, sampled), _, _ = _run(chunk=7)
    report = summarize(greedy, sampled)
    assert report["accuracy"] == pytest.approx(greedy.correct_PG.mean())
    assert report["avg@4"] == pytest.approx(sampled.correct_PG.mean()) == pytest.approx(report["pass@1"])
    per_problem = [1.0 if row.any() else 0.0 for row in sampled.correct_PG]  # pass@n with n samples: any correct
    assert report["pass@4"] == pytest.approx(np.mean(per_problem))
    assert report["sampled/truncated_fraction"] == pytest.approx(sampled.truncated_PG.mean())
    assert report["sampled/reward_mean"] == pytest.approx(sampled.reward_PG.mean())
    assert set(summarize(greedy, None)) == {"accuracy", "response_length_mean", "response_length_correct",
                                            "response_length_incorrect", "truncated_fraction", "reward_mean"}
    settings = EvalSettings(max_new_tokens=BUDGET, samples=4, temperature=0.7, seed=11, chunk_prompts=7)
    row = eval_metrics(Actor(StandInClient(), StandInScorer(), StandInTokenizer()), EXAMPLES, PROMPTS, settings)
    assert row["eval/num_prompts"] == 7 and row["eval/pass@4"] == report["pass@4"]
    assert eval_summary(row) == f"accuracy {report['accuracy']:.3f} avg@4 {report['avg@4']:.3f} " \
                                f"pass@4 {report['pass@4']:.3f}"


def test_eval_settings_refuse_what_cannot_be_sampled():
    for kwargs, match in [({"samples": 2, "temperature": 0.0}, "temperature"), ({"samples": -1}, "samples"),
                          ({"samples": 0, "greedy": False}, "neither"), ({"max_new_tokens": 0}, "max_new_tokens")]:
        with pytest.raises(ValueError, match=match):
            EvalSettings(**{"max_new_tokens": 4, **kwargs})


def test_reasoning_gym_suites_are_seeded_and_mixes_report_per_task():
    quick = load_suite("chain_sum_1digit", size=5, seed=1)
    assert len(quick.examples) == 5 and quick.task_names() == ["chain_sum"]
    assert [e.question for e in load_suite("chain_sum_1digit", size=5, seed=1).examples] == \
        [e.question for e in quick.examples]
    assert [e.question for e in load_suite("chain_sum_1digit", size=5, seed=2).examples] != \
        [e.question for e in quick.examples]
    mix = load_suite("arithmetic", size=3, seed=0)
    assert mix.task_names() == ["chain_sum", "products", "basic_arithmetic", "gcd"] and len(mix.examples) == 12
    assert all(e.entry is not None and e.answer for e in mix.examples)  # the task reward needs the raw entry
    assert load_suite("rg:products,gcd", size=2, seed=0).task_names() == ["products", "gcd"]
    for spec, size, flag, match in [("arithmetc", 2, "--suite", "did you mean arithmetic"),
                                    ("rg:chain_summ", 2, "--suite", "did you mean chain_sum"),
                                    ("rg:", 2, "--suite", "at least one"), ("arithmetic", 0, "--size", "at least 1"),
                                    ("missing.jsonl", 0, "--suite", "no such file")]:
        with pytest.raises(ConfigError, match=match) as error:
            load_suite(spec, size=size, seed=0)
        assert error.value.key == flag


def test_jsonl_suites_read_problem_or_question_and_cut_gsm8k_answers(tmp_path):
    math500 = tmp_path / "math500.jsonl"
    math500.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n\n" +
                       json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    suite = load_suite(str(math500), size=0, seed=0)
    assert suite.name == "math500"
    assert [(e.question, e.answer) for e in suite.examples] == [("1+1?", "2"), ("2+2?", "4")]
    assert len(load_suite(str(math500), size=1, seed=0).examples) == 1
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "Tom has 3...", "answer": "3 + 4 = 7\n#### 7"}) + "\n")
    assert load_suite(str(gsm8k), size=0, seed=0).examples[0].answer == "7"
    for text, kwargs, flag in [('{"q": 1, "answer": 2}\n', {}, "--problem-field"),
                               ('{"problem": 1}\n', {}, "--answer-field"),
                               ('{"problem": 1, "answer": 2}\n', {"problem_field": "body"}, "--problem-field"),
                               ("not json\n", {}, "--suite"), ("\n", {}, "--suite")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ConfigError) as error:
            load_suite(str(bad), size=0, seed=0, **kwargs)
        assert error.value.key == flag


def test_suites_are_what_the_training_data_path_loads(tmp_path):
    """One data path: a suite's examples (ids, questions, answers, entries) are data/sources.py's for the same
    reasoning-gym task and seed, or the same file."""
    config = DataConfig(source="reasoning_gym", task="products", size=3, eval_size=0)
    assert load_suite("rg:products", size=3, seed=5).examples == load_dataset(config, 5).train
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"so\n#### {i + 1}"}) + "\n"
                            for i in range(4)))
    files = DataConfig(source="jsonl", path=str(path), size=0, eval_size=0)
    assert load_suite(str(path), size=0, seed=0).examples == load_dataset(files, 0).train


def test_report_rows_table_and_files(tmp_path):
    suite = load_suite("arithmetic", size=2, seed=0)
    rng = np.random.default_rng(0)

    def samples(group):
        correct = rng.random((8, group)) < 0.5
        return EvalSamples(tuple(f"text {i}" for i in range(8 * group)), correct, correct.astype(np.float32),
                           rng.integers(1, 9, (8, group)), np.zeros((8, group), bool))

    greedy, sampled = samples(1), samples(4)
    rows = report_rows(suite, greedy, sampled)
    assert list(rows) == ["chain_sum", "products", "basic_arithmetic", "gcd", "all"]
    assert rows["gcd"]["problems"] == 2
    assert rows["gcd"]["pass@4"] == pytest.approx(np.mean(sampled.correct_PG[6:].any(axis=1)))
    assert rows["all"]["accuracy"] == pytest.approx(greedy.correct_PG.mean())
    table = markdown_table(rows).splitlines()
    assert table[0] == ("| task | problems | accuracy (greedy) | avg@4 | pass@1 | pass@2 | pass@4 | length correct "
                        "| length incorrect | truncated |")
    assert len(table) == 2 + 5 and table[-1].startswith("| all | 8 | ")
    paths = write_report(str(tmp_path / "out"), {"suite": "arithmetic", "k": 4}, rows, suite, greedy, sampled)
    with open(paths["results.json"]) as f:
        assert json.load(f)["results"]["all"]["pass@4"] == rows["all"]["pass@4"]
    with open(paths["completions.jsonl"]) as f:
        completions = [json.loads(line) for line in f]
    assert len(completions) == 8 + 32 and completions[-1]["kind"] == "sampled" and completions[-1]["sample"] == 3
    assert "| all | 8 |" in open(paths["results.md"]).read()


def test_the_cli_refuses_bad_flags_in_one_line_before_starting_anything(tmp_path, capsys, tiny_model):
    from drgrpo_jax.evaluate.cli import main, resolve_model

    model = tiny_model
    for argv, words in [(["--model", str(tmp_path / "nope"), "--suite", "arithmetic"], "--model"),
                        (["--model", str(model), "--suite", "arithmetc"], "did you mean arithmetic"),
                        (["--model", str(model), "--suite", "arithmetic", "--k", "2", "--temperature", "0"],
                         "temperature"),
                        (["--model", str(model), "--suite", "arithmetic", "--step", "3"], "--step"),
                        (["--model", "http://a:1", "--model", str(model), "--suite", "arithmetic"], "only http")]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "final").mkdir()
    (run_dir / "config.yaml").write_text("model: {path: x}\nrollout: {max_new_tokens: 24}\n")
    source = resolve_model([str(run_dir)])
    assert source.path == os.path.join(str(run_dir), "final") and source.run_config.rollout.max_new_tokens == 24
    assert resolve_model([str(run_dir / "checkpoints" / "7")]).checkpoint == (str(run_dir), 7)
    assert resolve_model(["http://a:1", "http://b:2"]).urls == ("http://a:1", "http://b:2")
    with pytest.raises(ConfigError, match="weights/v5"):
        resolve_model([str(run_dir)], step=5)
