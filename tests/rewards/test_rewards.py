"""Rewards: built-in components, user functions by import path, time limits, crashes, NaN, clean shutdown."""

import os
import time

import numpy as np
import pytest

from drgrpo_jax.config.schema import BUILTIN_REWARDS, DataConfig, RewardConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.data.sources import load_dataset
from drgrpo_jax.errors import ConfigError, RewardError
from drgrpo_jax.rewards.functions import build_reward_fns, extract_answer, overlong_penalty
from drgrpo_jax.rewards.scorer import RewardScorer

TIMEOUT_S = 4.0  # above math-verify's slowest first call on a loaded 2-core machine, below "stalled"


def user_reward(completion: str, example: Example) -> float:
    """A user reward whose behaviour the completion picks: hang, raise, die, NaN, a string, or 0.5."""
    if "HANG" in completion:
        time.sleep(3600)
    if "RAISE" in completion:
        raise RuntimeError("user code failed")
    if "EXIT" in completion:
        os._exit(3)  # a crash that takes the worker down with it
    if "NAN" in completion:
        return float("nan")
    if "STR" in completion:
        return "0.5"  # type: ignore[return-value]
    if "NONE" in completion:
        return None  # type: ignore[return-value]  # a missing component
    return 0.5


@pytest.fixture(scope="module")
def examples():
    return load_dataset(DataConfig(task="basic_arithmetic", size=4, eval_size=0), seed=0).train


@pytest.fixture(scope="module")
def scorer():
    config = RewardConfig(
        functions=("math_verify", "format", "task", "test_rewards:user_reward"),
        weights=(1.0, 0.1, 1.0, 2.0),
        timeout_s=TIMEOUT_S,
        num_workers=2,
    )
    with RewardScorer(config) as scorer:
        yield scorer


def test_extract_answer():
    assert extract_answer("so \\boxed{\\frac{1}{2}} done", "boxed") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} then \\boxed{2}", "boxed") == "2"
    assert extract_answer("cut off \\boxed{12", "boxed") is None
    assert extract_answer("<answer>1</answer> <answer> 7 </answer>", "answer_tags") == "7"
    assert extract_answer("no answer here", "answer_tags") is None


@pytest.mark.subprocess  # reward worker processes
def test_builtins_and_user_components(scorer, examples):
    right, wrong = examples[0], examples[1]
    completions = [
        f"The result is \\boxed{{{right.answer}}}.",
        f"I think it is {right.answer}.",  # right but not in the format
        "The result is \\boxed{123456789}.",
    ]
    result = scorer.score(completions, [right, right, wrong])
    assert result.names == ("math_verify", "format", "task", "user_reward")
    expected_NK = np.array([[1.0, 1.0, 1.0, 0.5], [1.0, 0.0, 0.0, 0.5], [0.0, 1.0, 0.0, 0.5]], np.float32)
    np.testing.assert_array_equal(result.components_NK, expected_NK)
    np.testing.assert_allclose(result.total_N(), expected_NK @ np.array([1.0, 0.1, 1.0, 2.0], np.float32))
    assert result.timeouts_F.sum() == 0 and result.errors_F.sum() == 0
    metrics = result.metrics()
    assert metrics["reward/format"] == pytest.approx(2 / 3) and metrics["reward_errors"] == 0


@pytest.mark.subprocess  # reward worker processes
def test_math_verify_is_equivalence_not_string_match(scorer):
    half = Example("x/0", "q", "\\frac{1}{2}")
    result = scorer.score(["so \\boxed{0.5}", "so \\boxed{1/2}", "so \\boxed{2}"], [half] * 3)
    np.testing.assert_array_equal(result.components_NK[:, 0], [1.0, 1.0, 0.0])
    assert result.errors_F[2] == 3  # 'task' on a prompt without a reasoning-gym entry: counted, scored 0


@pytest.mark.subprocess  # reward worker processes
def test_hung_calls_are_killed_counted_and_do_not_stall(scorer, examples):
    completions = ["\\boxed{1} HANG", "\\boxed{1}", "\\boxed{1} HANG", "\\boxed{1}"]
    start = time.monotonic()
    result = scorer.score(completions, examples[:4])
    elapsed = time.monotonic() - start
    np.testing.assert_array_equal(result.timeouts_F, [0, 0, 0, 2])
    np.testing.assert_array_equal(result.components_NK[:, 3], [0.0, 0.5, 0.0, 0.5])
    np.testing.assert_array_equal(result.components_NK[:, 1], [1.0] * 4)  # other components unaffected
    # Two workers time out side by side, so the messages may come in either order.
    hung = " ".join(result.error_messages)
    assert "over 4.0 s" in hung and examples[0].prompt_id in hung and examples[2].prompt_id in hung
    # Two hung calls on two workers run side by side: about one time limit plus worker restarts, not an hour.
    assert elapsed < 3 * TIMEOUT_S + 60
    again = scorer.score(["\\boxed{1}"], examples[:1])  # the replaced workers serve the next batch
    assert again.timeouts_F.sum() == 0 and again.components_NK[0, 3] == 0.5


@pytest.mark.subprocess  # reward worker processes
def test_crashes_score_zero_and_are_counted(scorer, examples):
    completions = ["RAISE", "EXIT", "fine"]
    result = scorer.score(completions, examples[:3])
    np.testing.assert_array_equal(result.components_NK[:, 3], [0.0, 0.0, 0.5])
    assert result.errors_F[3] == 2 and result.timeouts_F.sum() == 0
    joined = " | ".join(result.error_messages)
    assert "RuntimeError: user code failed" in joined and "worker died (exit code 3)" in joined


@pytest.mark.subprocess  # reward worker processes
@pytest.mark.parametrize("completion, what", [("STR", "str '0.5'"), ("NONE", "NoneType None")])
def test_missing_or_non_numeric_component_stops_with_prompt_and_component(scorer, examples, completion, what):
    with pytest.raises(RewardError) as info:
        scorer.score(["fine", completion], examples[:2])
    message = str(info.value)
    assert f"'user_reward' returned {what}, not a number, for prompt {examples[1].prompt_id}" in message, message
    assert "\n" not in message
    assert scorer.score(["fine"], examples[:1]).components_NK[0, 3] == 0.5  # the pool still serves the next batch


@pytest.mark.subprocess  # reward worker processes
def test_nan_reward_stops_with_prompt_and_component(scorer, examples):
    with pytest.raises(RewardError) as info:
        scorer.score(["fine", "NAN"], examples[:2])
    message = str(info.value)
    assert "'user_reward'" in message and examples[1].prompt_id in message and "nan" in message
    assert "\n" not in message


def test_bad_import_paths_are_config_errors():
    with pytest.raises(ConfigError) as info:
        build_reward_fns(RewardConfig(functions=("math_verify", "no_such_module_xyz:fn")))
    assert str(info.value).startswith("reward.functions[1]: cannot import 'no_such_module_xyz'")
    with pytest.raises(ConfigError) as info:
        build_reward_fns(RewardConfig(functions=("test_rewards:missing_fn",)))
    assert str(info.value).startswith("reward.functions[0]: 'test_rewards' has no function 'missing_fn'")


@pytest.mark.subprocess  # reward worker processes
def test_close_stops_every_worker():
    scorer = RewardScorer(RewardConfig(functions=("format",), num_workers=1, timeout_s=TIMEOUT_S))
    processes = [worker.process for worker in scorer._workers]
    assert scorer.score(["\\boxed{3}"], [Example("p/0", "q", "3")]).components_NK[0, 0] == 1.0
    scorer.close()
    assert all(process.poll() is not None for process in processes)


@pytest.mark.subprocess  # reward worker processes
def test_a_job_wide_sigterm_leaves_the_workers_to_the_trainer():
    """`scancel --signal=TERM` signals every process of the job step: the workers ignore it, from their first line
    (a worker killed while the pool started failed a preempted SLURM run with RewardError instead of exit 42)."""
    import signal

    scorer = RewardScorer(RewardConfig(functions=("format",), num_workers=1, timeout_s=TIMEOUT_S))
    try:
        for worker in scorer._workers:
            worker.process.send_signal(signal.SIGTERM)
        assert scorer.score(["\\boxed{3}"], [Example("p/0", "q", "3")]).components_NK[0, 0] == 1.0
        assert all(worker.process.poll() is None for worker in scorer._workers)
    finally:
        scorer.close()


def test_functions_are_named_after_the_builtin_or_the_imported_function():
    specs = build_reward_fns(RewardConfig(functions=("math_verify", "test_rewards:user_reward")))
    assert [s.name for s in specs] == ["math_verify", "user_reward"]


def test_the_config_names_exactly_the_implemented_builtins():
    """reward.functions' built-in names (config/schema.py) are what rewards/functions.py implements, no more, no
    less; the correctness components (rollout/record.py reads them) are built-ins."""
    from drgrpo_jax.rewards import functions

    specs = build_reward_fns(RewardConfig(functions=BUILTIN_REWARDS))
    assert tuple(s.name for s in specs) == BUILTIN_REWARDS
    assert set(functions._BUILTINS) | set(functions.LENGTH_REWARDS) == set(BUILTIN_REWARDS)
    assert set(functions.CORRECTNESS_REWARDS) <= set(BUILTIN_REWARDS)


def user_dict_reward(completion: str, example: Example) -> dict:
    """Several components from one call; the completion picks a missing key, a bad value or a failure."""
    if "RAISE" in completion:
        raise RuntimeError("user code failed")
    out = {"correct": float("right" in completion), "length": float(len(completion)), "debug": 7.0}
    if "DROP" in completion:
        del out["length"]
    if "BAD" in completion:
        out["length"] = [1.0]
    return out


@pytest.fixture(scope="module")
def dict_scorer():
    config = RewardConfig(functions=("test_rewards:user_dict_reward", "format"),
                          components=("length", "format", "correct"), timeout_s=TIMEOUT_S, num_workers=1)
    with RewardScorer(config) as scorer:
        yield scorer


@pytest.mark.subprocess  # reward worker processes
def test_components_can_be_keys_of_a_returned_dict(dict_scorer, examples):
    result = dict_scorer.score(["right \\boxed{1}", "wrong"], examples[:2])
    assert result.names == ("length", "format", "correct") and result.weights == (1.0, 1.0, 1.0)
    assert result.functions == ("user_dict_reward", "format")
    np.testing.assert_array_equal(result.components_NK, [[15.0, 1.0, 1.0], [5.0, 0.0, 0.0]])  # 'debug' unused
    assert set(result.metrics()) >= {"reward/length", "reward/correct", "reward/user_dict_reward_errors"}


@pytest.mark.subprocess  # reward worker processes
def test_a_failed_call_scores_its_components_zero_and_is_counted(dict_scorer, examples):
    result = dict_scorer.score(["RAISE \\boxed{1}", "right"], examples[:2])
    np.testing.assert_array_equal(result.components_NK, [[0.0, 1.0, 0.0], [5.0, 0.0, 1.0]])
    assert result.errors_F.tolist() == [1, 0]


@pytest.mark.subprocess  # reward worker processes
@pytest.mark.parametrize("completion, message", [
    ("DROP", "reward component 'length' is missing for prompt {id} (response 1): no reward function returned it"),
    ("BAD", "reward component 'length' returned list [1.0], not a number, for prompt {id} (response 1)"),
])
def test_a_missing_or_bad_dict_component_stops_with_prompt_and_component(dict_scorer, examples, completion, message):
    with pytest.raises(RewardError) as info:
        dict_scorer.score(["fine", completion], examples[:2])
    assert message.format(id=examples[1].prompt_id) in str(info.value), str(info.value)
    assert dict_scorer.score(["fine"], examples[:1]).components_NK[0, 0] == 4.0  # still serving


@pytest.mark.subprocess  # reward worker processes
def test_given_components_fill_their_columns_and_a_function_may_not_give_one_too(examples):
    """An episode's own rewards (environment.reward_components) come in as `given` columns beside the functions'."""
    config = RewardConfig(functions=("format",), components=("format", "tool_calls"), weights=(1.0, 0.5),
                          num_workers=1)
    with RewardScorer(config) as scorer:
        result = scorer.score(["so \\boxed{1}", "no"], examples[:2], given={"tool_calls": [2, 0]})
        np.testing.assert_array_equal(result.components_NK, [[1.0, 2.0], [0.0, 0.0]])
        np.testing.assert_array_equal(result.total_N(), [2.0, 0.0])
        with pytest.raises(ValueError, match="given component 'turns' is not in reward.components"):
            scorer.score(["no"], examples[:1], given={"turns": [1]})
        with pytest.raises(ValueError, match="1 values of given component 'tool_calls' for 2 completions"):
            scorer.score(["no", "no"], examples[:2], given={"tool_calls": [1]})
        with pytest.raises(RewardError, match="'format' was given twice .* by one and the episode"):
            scorer.score(["no"], examples[:1], given={"format": [1.0]})


@pytest.mark.subprocess  # reward worker processes
def test_a_dict_needs_reward_components_and_a_number_needs_its_name_listed(examples):
    with RewardScorer(RewardConfig(functions=("test_rewards:user_dict_reward",), num_workers=1)) as scorer:
        with pytest.raises(RewardError, match="'user_dict_reward' returned a dict .* list the keys to use in "
                                              "reward.components"):
            scorer.score(["fine"], examples[:1])
    config = RewardConfig(functions=("format",), components=("correct",), num_workers=1)
    with RewardScorer(config) as scorer:
        with pytest.raises(RewardError, match="'format' returned a number .* not in reward.components"):
            scorer.score(["fine"], examples[:1])


@pytest.mark.subprocess  # a script run as a child process
def test_works_from_a_script_without_main_guard(tmp_path):
    """Workers are fresh interpreters: a plain script (or notebook) is not re-run in them."""
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "from drgrpo_jax.config.schema import RewardConfig\n"
        "from drgrpo_jax.data.examples import Example\n"
        "from drgrpo_jax.rewards.scorer import RewardScorer\n"
        "with RewardScorer(RewardConfig(functions=('format',), num_workers=1)) as scorer:\n"
        "    print(scorer.score(['\\\\boxed{3}', 'no'], [Example('p/0', 'q', '3')] * 2).components_NK[:, 0].tolist())\n"
    )
    process = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.strip() == "[1.0, 0.0]"


@pytest.mark.subprocess  # a script run as a child process
def test_hung_worker_dies_with_a_killed_parent(tmp_path):
    """A trainer killed mid-scoring leaves no worker behind, even one stuck in a hung call."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from drgrpo_jax.config.schema import RewardConfig\n"
        "from drgrpo_jax.data.examples import Example\n"
        "from drgrpo_jax.rewards.scorer import RewardScorer\n"
        "scorer = RewardScorer(RewardConfig(functions=('test_rewards:user_reward',), num_workers=1, timeout_s=3600))\n"
        "print(scorer._workers[0].process.pid, flush=True)\n"
        "scorer.score(['HANG'], [Example('p/0', 'q', '3')])\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker_pid = int(parent.stdout.readline())
    time.sleep(6)  # the worker starts (~2-3 s) and enters the hung call
    assert _alive(worker_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker_pid):
        time.sleep(0.2)
    assert not _alive(worker_pid)


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_overlong_penalty_by_hand():
    # DAPO's soft punishment with budget 100 and a 20-token buffer: 0 up to 80 tokens, then linear to -1 at 100.
    penalty = overlong_penalty(np.array([0, 10, 80, 81, 90, 99, 100]), budget=100, buffer=20)
    np.testing.assert_allclose(penalty, [0, 0, 0, -0.05, -0.5, -0.95, -1.0], rtol=1e-6)
    assert penalty.dtype == np.float32
    np.testing.assert_array_equal(overlong_penalty(np.array([3, 4]), budget=4, buffer=4), [-0.75, -1.0])


@pytest.mark.subprocess  # the scorer starts its reward workers
def test_overlong_is_a_component_of_the_token_lengths(examples):
    config = RewardConfig(functions=("format", "overlong"), weights=(1.0, 0.5), overlong_buffer=20, num_workers=1,
                          timeout_s=TIMEOUT_S)
    with RewardScorer(config, budget=100) as scorer:
        result = scorer.score(["\\boxed{1}", "none", "\\boxed{2}"], [examples[0]] * 3, lengths=[10, 90, 100])
        assert result.names == ("format", "overlong")
        np.testing.assert_allclose(result.components_NK, [[1, 0], [0, -0.5], [1, -1]], rtol=1e-6)
        np.testing.assert_allclose(result.total_N(), [1, -0.25, 0.5], rtol=1e-6)
        with pytest.raises(ValueError, match="token length"):
            scorer.score(["x"], [examples[0]])
    with pytest.raises(ValueError, match="budget"):
        RewardScorer(config)


def test_overlong_works_with_gdpo():
    # A [P, G, K] batch of (correct, overlong): the length component shifts advantages within a group.
    from drgrpo_jax import advantages

    correct = np.array([[1.0, 1.0, 0.0, 0.0]])
    overlong = overlong_penalty(np.array([[10, 95, 10, 95]]), budget=100, buffer=20)
    combined = advantages.gdpo(np.stack([correct, overlong], axis=-1), [1.0, 0.5])
    assert combined[0, 0] > combined[0, 1] > combined[0, 2] > combined[0, 3]
