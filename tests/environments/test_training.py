"""The trainer on multi-turn episodes (a tiny chat model, an environment that always answers, two steps, its
periodic evaluation in episodes too), `evaluate --tools`, and the environment section's config rules."""

import json

import pytest

from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.rules import validate
from drgrpo_jax.errors import ConfigError

from support.chat_models import write_chat_model
from support.trainer_runs import start_trainer, trainer_overrides, write_prompts


def _overrides(model, prompts, output_dir):
    base = trainer_overrides(model, prompts, output_dir, steps=2)
    keep = [o for o in base if not o.startswith(("rollout.max_new_tokens", "rollout.max_prompt_tokens",
                                                 "train.eval_every"))]
    return keep + ["rollout.max_new_tokens=40", "rollout.max_prompt_tokens=48", "train.eval_every=2",
                   "train.eval_samples=2", "reward.components=[has_letter_a,format,turn]",
                   "environment.reward_components=[turn]",
                   "environment.factory=support.chat_models:Chatty", "environment.max_turns=3",
                   "environment.max_turn_tokens=8", "environment.max_model_tokens=20",
                   "rollout.service_prefix_cache_bytes=-1"]


@pytest.mark.subprocess
def test_the_trainer_trains_on_multi_turn_episodes(tmp_path):
    model = write_chat_model(str(tmp_path / "model"))
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"), 16)
    process = start_trainer(_overrides(model, prompts, tmp_path / "run"))
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 2] and all(row["eval/num_prompts"] == 4 for row in evals)
    rows = [row for row in rows if "episode/turns" in row]
    assert len(rows) == 2
    for row in rows:
        assert 1 < row["episode/turns"] <= 3 and row["episode/environment_tokens"] > 0
        assert 0 < row["episode/model_tokens"] <= 20
        # T_w counts only the model's tokens: the windows' mean token count is the rollout's model tokens split
        # over its two minibatches (16 rows, 8 a window).
        assert row["num_tokens"] == pytest.approx(row["episode/model_tokens"] * 8)
        assert row["loss"] == row["loss"]  # not NaN
        # Chatty gives 0.5 a turn it answers (not one cut by a limit): the episode's sum is a reward component.
        assert 0 < row["reward/turn"] <= 0.5 * row["episode/turns"]
        # The child service keeps a prefix cache (rollout.service_prefix_cache_bytes): the step logs what it did.
        assert row["rollout/prefix_cache_cached_blocks"] > 0 and 0 <= row["rollout/prefix_cache_hit_rate"] <= 1


@pytest.mark.subprocess
def test_episodes_compose_with_async_rollouts_dynamic_sampling_and_lora(tmp_path):
    model = write_chat_model(str(tmp_path / "model"))
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"), 16)
    overrides = [o for o in _overrides(model, prompts, tmp_path / "run") if not o.startswith("train.eval")]
    overrides += ["train.eval_every=0", "rollout.async=true", "rollout.max_staleness=1", "algorithm.tis_cap=2.0",
                  "rollout.dynamic_sampling=true", "rollout.max_resample_rounds=1", "model.lora.rank=4"]
    process = start_trainer(overrides)
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "episode/turns" in row]
    assert len(rows) == 2 and all("sampling_rounds" in row for row in rows)
    # A step whose groups all lack a signal trains on padding only: its episode means are null, not made up.
    trained = [row for row in rows if row["episode/turns"] is not None]
    assert trained and all(row["episode/turns"] > 1 and row["episode/environment_tokens"] > 0 for row in trained)
    assert all(row["num_tokens"] == 0 for row in rows if row["episode/turns"] is None)
    assert rows[1]["staleness"] == 1  # step 2 was sampled during step 1's update


@pytest.mark.subprocess
@pytest.mark.slow  # one episode run of 4 steps (~1-2 minutes on 2 busy cores)
def test_episodes_run_two_versions_behind_with_k_2_staleness(tmp_path):
    """rollout.max_staleness=2: each step's episodes are sampled ahead by the version two before it (pushes wait
    behind the queued episodes, so an episode is sampled by one version)."""
    model = write_chat_model(str(tmp_path / "model"))
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"), 16)
    overrides = [o for o in _overrides(model, prompts, tmp_path / "run") if not o.startswith("train.")]
    overrides += ["train.steps=4", "train.save_every=4", "train.eval_every=0", "rollout.async=true",
                  "rollout.max_staleness=2", "algorithm.tis_cap=2.0"]
    process = start_trainer(overrides)
    _, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["weight_version"] for row in rows] == [0, 0, 0, 1]
    assert [row["staleness_max"] for row in rows] == [0, 1, 2, 2]
    assert [row["queue_depth"] for row in rows] == [2, 2, 1, 0]
    for row in rows:
        assert row["episode/turns"] > 1 and row["episode/environment_tokens"] > 0 and row["loss"] == row["loss"]
        assert row[f"groups_at_staleness/{row['staleness_max']}"] == 1.0  # a round is sampled by one version


def test_environment_config_errors_name_the_key(tmp_path):
    base = ["model.path=x", "rollout.max_new_tokens=64", "environment.max_model_tokens=32"]
    for extra, key in ((["environment.tools=[calculator]", "environment.max_model_tokens=65"],
                        "environment.max_model_tokens"),
                       (["environment.tools=[calculatr]"], "environment.tools[0]"),
                       (["environment.tools=[calculator,calculator]"],
                        "environment.tools"),
                       (["environment.factory=not a path"], "environment.factory"),
                       (["environment.reward_components=[turns]"], "environment.reward_components"),
                       (["environment.tools=[calculator]", "environment.reward_components=[turns]"],
                        "environment.reward_components[0]"),
                       (["environment.tools=[calculator]", "reward.components=[turns]",
                         "environment.reward_components=[turns,turns]"], "environment.reward_components"),
                       (["environment.tools=[python]",
                         "environment.python_timeout_s=0"], "environment.python_timeout_s"),
                       (["environment.tools=[calculator]",
                         "data.use_chat_template=false"], "data.use_chat_template")):
        with pytest.raises(ConfigError, match=f"^{key.replace('[', '.').replace(']', '.')}"):
            validate(load_config(None, base + extra))


def test_the_budget_is_the_model_tokens_of_a_trajectory():
    from drgrpo_jax.config.derived import step_configs

    config = load_config(None, ["model.path=x", "rollout.max_new_tokens=64", "environment.tools=[calculator]",
                                "environment.max_model_tokens=32"])
    assert step_configs(config)[0].loss.budget == 32
    assert step_configs(load_config(None, ["model.path=x", "rollout.max_new_tokens=64"]))[0].loss.budget == 64


@pytest.mark.subprocess
def test_evaluate_with_tools_answers_in_episodes(tmp_path):
    import subprocess
    import sys

    from support.paths import REPO
    from support.trainer_runs import trainer_env

    model = write_chat_model(str(tmp_path / "model"))
    suite = tmp_path / "sums.jsonl"
    suite.write_text("".join(json.dumps({"problem": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(4)))
    output = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "drgrpo_jax.evaluate", "--model", model, "--suite", str(suite),
                           "--k", "2", "--temperature", "1.0", "--max-new-tokens", "24", "--tools", "calculator",
                           "--template", "{question}", "--reward", "support.reward_functions:has_letter_a",
                           "-o", str(output)], cwd=REPO, env=trainer_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((output / "results.json").read_text())
    assert results["tools"] == ["calculator"] and results["results"]["all"]["problems"] == 4
    completions = [json.loads(line) for line in (output / "completions.jsonl").read_text().splitlines()]
    assert sorted(c["kind"] for c in completions) == ["greedy"] * 4 + ["sampled"] * 8


def test_the_tool_quickstart_config_is_valid():
    import os

    from drgrpo_jax.environments.build import build_tools, read_few_shot
    from drgrpo_jax.environments.calculator import calculator
    from drgrpo_jax.environments.calls import CallFormat, parse_calls

    from support.paths import REPO

    config = load_config(os.path.join(REPO, "configs", "tool_quickstart.yaml"))
    validate(config)
    assert config.environment.enabled and [t.name for t in build_tools(config.environment)] == ["calculator"]
    few_shot = read_few_shot(os.path.join(REPO, config.environment.few_shot))
    assert [m["role"] for m in few_shot] == ["user", "assistant", "tool", "assistant"] * 2
    assert step_budget(config) == config.environment.max_model_tokens < config.rollout.max_new_tokens
    # the worked episodes are right: each call's result is the calculator's, and the answer boxes it
    for user, call, result, answer in zip(*[iter(few_shot)] * 4):
        (parsed,) = parse_calls(call["content"], CallFormat(config.environment.call_format))
        assert parsed.name == "calculator" and parsed.arguments["expression"] in user["content"]
        assert result["content"] == calculator(**parsed.arguments) and f"\\boxed{{{result['content']}}}" in \
            answer["content"]


def test_every_tool_quickstart_prompt_fits_its_max_prompt_tokens():
    """The opening (system message with the tools, the worked episodes, the question) of every training and
    held-out problem, through SmolLM2's own chat template: the trainer stops on a prompt over the limit."""
    import os

    from drgrpo_jax.config.load import resolve_model_path
    from drgrpo_jax.data.sources import load_dataset
    from drgrpo_jax.environments.build import build_episodes
    from drgrpo_jax.models.pretrained import load_tokenizer

    from support.paths import REPO

    config = load_config(os.path.join(REPO, "configs", "tool_quickstart.yaml"))
    tokenizer = load_tokenizer(resolve_model_path(config.model.path), config.model.tokenizer_path)
    episodes = build_episodes(config, tokenizer)
    dataset = load_dataset(config.data, config.run.seed)
    environment = episodes.make_environment()
    renderer = episodes.renderer(environment)
    lengths = [len(renderer.opening_ids(environment.reset(episodes.example(example))))
               for example in dataset.train + dataset.eval]
    assert len(lengths) == config.data.size + config.data.eval_size
    assert max(lengths) <= config.rollout.max_prompt_tokens


def step_budget(config):
    from drgrpo_jax.config.derived import step_configs

    return step_configs(config)[0].loss.budget


@pytest.mark.subprocess
@pytest.mark.slow  # three trainer runs with their services
def test_a_resumed_episode_run_reproduces_the_uninterrupted_one(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file

    from support.trainer_runs import kill_and_resume

    model = write_chat_model(str(tmp_path / "model"))
    prompts = write_prompts(str(tmp_path / "prompts.jsonl"), 16)

    def overrides(name):
        base = [o for o in _overrides(model, prompts, tmp_path / name) if not o.startswith(("train.", "run.sample"))]
        return base + ["train.steps=4", "train.save_every=2", "train.eval_every=0", "run.sample_every=0"]

    reference = start_trainer(overrides("uninterrupted"))
    _, stderr = reference.communicate(timeout=900)
    assert reference.returncode == 0, stderr[-3000:]
    kill_and_resume(overrides("killed"), tmp_path / "killed", checkpoint=2, timeout=900)

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k and "per_second" not in k
                 and k != "peak_rss_gb"} for line in lines]

    assert rows("killed")[-2:] == rows("uninterrupted")[-2:] and len(rows("uninterrupted")) == 4
    assert all(row["episode/environment_tokens"] > 0 for row in rows("uninterrupted"))
    got = load_file(str(tmp_path / "killed" / "final" / "model.safetensors"))
    want = load_file(str(tmp_path / "uninterrupted" / "final" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.subprocess
def test_the_tool_probe_reports_call_rates_and_an_episode_with_its_mask(tmp_path):
    import subprocess
    import sys

    from support.paths import REPO
    from support.trainer_runs import trainer_env

    model = write_chat_model(str(tmp_path / "model"), max_position_embeddings=4096)  # characters: a long prompt
    done = subprocess.run([sys.executable, "scripts/probe_tool_use.py", "--config", "configs/tool_quickstart.yaml",
                           "--episodes", "3", "--held-out", f"model.path={model}", "data.size=8", "data.eval_size=4",
                           "environment.max_turn_tokens=8"], cwd=REPO, env=trainer_env(), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["episodes"] == 3 and 0 <= report["episodes_with_a_call"] <= 3 and report["correct"] >= 0
    first = report["first_episode"]
    assert first[0]["model"] and all(a["model"] != b["model"] for a, b in zip(first, first[1:]))  # alternating runs
    model_text = "".join(run["text"] for run in first if run["model"])
    assert 0 < len(model_text) and report["episode/model_tokens"] > 0
