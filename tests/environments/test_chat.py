"""Chat rendering: the opening and each environment turn as ids, appended to the model's without re-tokenising,
add up to the template's own rendering of the whole conversation; tools described when the template cannot."""

import pytest

from drgrpo_jax.environments.calculator import calculator
from drgrpo_jax.environments.calls import CallFormat
from drgrpo_jax.environments.chat import ChatRenderer, template_renders_tools
from drgrpo_jax.environments.tool_env import ToolEnvironment, tool_message
from drgrpo_jax.environments.tools import make_tool

from support.chat_models import CHATML, save_chat_tokenizer

# A ChatML template that renders tools itself, Qwen2.5-style: tools in the system turn, tool results in a user
# turn between <tool_response> tags.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [CHATML, TOOLS_CHATML], ids=["no-tools-template", "tools-template"])
@pytest.mark.parametrize("stopped", [True, False])
def test_turn_by_turn_ids_equal_the_whole_conversation_rendered(tmp_path, template, stopped):
    tokenizer = save_chat_tokenizer(str(tmp_path), template)
    tool = make_tool(calculator)
    renderer = ChatRenderer(tokenizer, [tool])
    assert renderer.native_tools == template_renders_tools(tokenizer) == (template is TOOLS_CHATML)
    env = ToolEnvironment([tool], few_shot=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    opening = env.reset({"prompt": "what is 2+3?"})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    model_turn = tokenizer.encode(call, add_special_tokens=False)
    if stopped:
        model_turn.append(renderer.turn_stop_id)
    observation = env.step(call)
    assert [m["content"] for m in observation.messages] == ["5"]
    ids = renderer.opening_ids(opening) + model_turn + renderer.continuation_ids(observation.messages, stopped)
    conversation = renderer.opening_messages(opening) + [{"role": "assistant", "content": call}] + \
        renderer._as_template_messages(observation.messages)
    whole = renderer._render(conversation, True)
    # The character tokenizer (capitals become <unk>) has one tokenisation per text: equal ids, equal rendering.
    assert ids == renderer.encode(whole)
    if template is CHATML:
        assert "calculator" in tokenizer.decode(renderer.opening_ids(opening))  # described in the system turn
        assert "<tool_response>\n5\n</tool_response>" in whole


def test_tag_format_describes_the_tools_even_where_the_template_could(tmp_path):
    tokenizer = save_chat_tokenizer(str(tmp_path), TOOLS_CHATML)
    renderer = ChatRenderer(tokenizer, [make_tool(calculator)], CallFormat("tag", "[c]", "[/c]"))
    assert not renderer.native_tools and "[c]" in renderer.tools_description()


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    rewriting = ("{% for m in messages %}{{ m['role'] }}{{ loop.length }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer = save_chat_tokenizer(str(tmp_path), rewriting)
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(ValueError, match="only appends"):
        renderer.continuation_ids([tool_message("calculator", "5")], model_stopped=False)


def test_no_chat_template_is_refused(tmp_path):
    tokenizer = save_chat_tokenizer(str(tmp_path), CHATML)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(tokenizer)
