"""Tools and their schemas, the call formats, the calculator and the tool environment (all in process)."""

import time
from typing import Annotated

import pydantic
import pytest

from drgrpo_jax.environments.calculator import calculate, calculator
from drgrpo_jax.environments.calls import CallFormat, MalformedCall, ToolCall, parse_calls
from drgrpo_jax.environments.tool_env import ToolEnvironment
from drgrpo_jax.environments.tools import import_object, make_tool
from drgrpo_jax.errors import CalculatorError, ConfigError, FieldError, ToolArgumentError


def add(a: int, b: Annotated[int, pydantic.Field(description="the second term")] = 1) -> int:
    """Add two integers.

    Longer text that stays out of the description."""
    return a + b


def test_schema_from_type_hints_and_docstring():
    schema = make_tool(add).schema()
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a"],
                       "properties": {"a": {"type": "integer"},
                                      "b": {"type": "integer", "default": 1, "description": "the second term"}}}}}


def test_arguments_are_checked_against_the_schema():
    tool = make_tool(add)
    assert tool.run({"a": 2, "b": 5}) == 7
    assert tool.run({"a": "3"}) == 4  # JSON-ish coercion, as pydantic reads it
    for bad, field in (({}, "a"), ({"a": "x"}, "a"), ({"a": 1, "c": 2}, "c")):
        with pytest.raises(ToolArgumentError, match=f"argument {field}"):
            tool.run(bad)


def test_a_function_without_hints_is_refused_naming_the_argument():
    def f(x):
        return x

    with pytest.raises(TypeError, match="'x' needs a type hint"):
        make_tool(f)


def test_import_object_names_the_key():
    assert import_object("drgrpo_jax.environments.calculator:calculator", "k") is calculator
    for path, reason in (("nocolon", "is not"), ("no_such_module_xyz:f", "cannot import"),
                         ("drgrpo_jax.environments.calculator:nothing", "has no")):
        with pytest.raises(ConfigError, match=f"environment.tools\\[0\\]: .*{reason}"):
            import_object(path, "environment.tools[0]")


@pytest.mark.parametrize("expression, value", [("1+2*3", "7"), ("7/2", "3.5"), ("(17*23)-4", "387"),
                                               ("2**-2", "0.25"), ("-3 // 2", "-2"), ("10 % 4", "2"),
                                               ("123456789 * 987654321", "121932631112635269"),
                                               ("0.1 + 0.2", "0.3")])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, reason", [("9**9**9", "exponent"), ("2**700", "digits"),
                                                ("1/0", "division by zero"), ("__import__('os')", "not a number"),
                                                ("x + 1", "not a number"), ("1 +", "cannot read"),
                                                ("1" * 600, "longer than"), ("1e400", "finite")])
def test_calculator_refuses_quickly(expression, reason):
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)
    assert time.monotonic() - start < 1.0


def test_hermes_calls_and_malformed_ones():
    text = ('Let me compute. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "x"')
    calls = parse_calls(text, CallFormat("hermes"))
    assert calls[:2] == [ToolCall("add", {"a": 1}), ToolCall("add", {"a": 2})]
    reasons = [c.reason for c in calls[2:]]
    assert all(isinstance(c, MalformedCall) for c in calls[2:])
    assert "not valid JSON" in reasons[0] and "JSON object" in reasons[1] and "name" in reasons[2]
    assert "without </tool_call>" in reasons[3]
    assert parse_calls("The answer is 4.", CallFormat()) == []


def test_llama3_json_and_tag_formats():
    llama = CallFormat("llama3_json")
    assert parse_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', llama) == [ToolCall("add", {"a": 1})]
    assert parse_calls("It is 4.", llama) == []
    assert isinstance(parse_calls("{not json", llama)[0], MalformedCall)
    tag = CallFormat("tag", open_tag="[[call]]", close_tag="[[/call]]")
    assert parse_calls('x [[call]]{"name": "add", "arguments": {"a": 3}}[[/call]]', tag) == [ToolCall("add", {"a": 3})]
    assert tag.example("add", {"a": 1}).startswith("[[call]]")
    with pytest.raises(FieldError, match="CallFormat.name"):
        CallFormat("xml")  # type: ignore[arg-type]
    with pytest.raises(FieldError, match="CallFormat.open_tag"):
        CallFormat("tag", open_tag="", close_tag="x")


def _call(name, **arguments):
    import json
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_tool_environment_answers_every_call_and_counts_failures():
    def boom(x: int) -> int:
        """Always fails."""
        raise RuntimeError("it broke")

    def hang(x: int) -> int:
        """Never returns in time."""
        time.sleep(5)
        return x

    env = ToolEnvironment([make_tool(calculator), make_tool(boom), make_tool(hang)], timeout_s=0.3)
    assert env.reset({"prompt": "What is 2+2?"}) == [{"role": "user", "content": "What is 2+2?"}]
    turn = (_call("calculator", expression="17*23") + _call("boom", x=1) + _call("hang", x=1)
            + _call("nope") + _call("calculator", expr="1") + "<tool_call>{bad</tool_call>"
            + _call("calculator", expression="1/0"))
    observation = env.step(turn)
    contents = [m["content"] for m in observation.messages]
    assert not observation.done and len(contents) == 7
    assert contents[0] == "391"
    assert contents[1] == "error: RuntimeError: it broke"
    assert contents[2].startswith("error: TimeoutError")
    assert "no tool named 'nope'" in contents[3] and "argument expr" in contents[4]
    assert "malformed tool call" in contents[5] and "division by zero" in contents[6]
    assert (observation.tool_calls, observation.tool_errors, observation.malformed_calls) == (4, 3, 3)
    assert all(m["role"] == "tool" for m in observation.messages)
    assert env.step("The answer is 4.").done


def test_tool_call_limit_ends_the_episode_with_a_message():
    env = ToolEnvironment([make_tool(calculator)], max_tool_calls=2)
    env.reset({"prompt": "q"})
    observation = env.step(_call("calculator", expression="1+1") * 3)
    assert observation.done and observation.tool_calls == 2
    assert "no more tool calls" in observation.messages[-1]["content"]


def test_few_shot_messages_come_before_the_question_and_a_bad_file_names_the_key(tmp_path):
    import json

    from drgrpo_jax.environments.build import read_few_shot

    good = tmp_path / "few_shot.json"
    good.write_text(json.dumps([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]))
    env = ToolEnvironment([make_tool(calculator)], few_shot=read_few_shot(str(good)), system_prompt="be brief")
    assert [m["role"] for m in env.reset({"prompt": "q"})] == ["system", "user", "assistant", "user"]
    for text in ("not json", json.dumps({"role": "user"}), json.dumps([{"role": "robot", "content": "x"}])):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match="^environment.few_shot: "):
            read_few_shot(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        read_few_shot(str(tmp_path / "missing.json"))
