"""The prompt rules the server and the registry's pyfunc share, on the demo tokenizer (one id per character:
``\\n`` 7, ``' '`` 8, ``'1'`` 25, ``':'`` 34, ``'Q'`` 57, ``'a'`` 73; ``<bos>`` 1, ``<think>`` 4, ``</think>`` 5)."""

from __future__ import annotations

import pytest

from components.data.tokenizer import DEMO_CHAT_TEMPLATE, ReasoningMarkers, TextTokenizer, build_demo_tokenizer
from components.serving.prompts import PromptError, PromptRules

DEMO_GENERATION_PROMPT = "{{- '<think>' -}}{%- endif -%}"
USER = [{"role": "user", "content": "Q:1\n"}]


def _rules(generation_prompt: str | None = None, markers: ReasoningMarkers | None = None) -> PromptRules:
    hf = build_demo_tokenizer()
    if generation_prompt is not None:
        assert hf.chat_template.endswith(DEMO_GENERATION_PROMPT)
        hf.chat_template = DEMO_CHAT_TEMPLATE.replace(DEMO_GENERATION_PROMPT, generation_prompt)
    return PromptRules(TextTokenizer(hf, markers))


@pytest.fixture(scope="module")
def rules() -> PromptRules:
    return _rules()


def test_chat_through_the_template(rules):
    # <bos> Q : 1 \n, then the template's generation prompt <think>: it thinks, nothing appended
    assert rules.chat(USER) == ([1, 57, 34, 25, 7, 4], True)


@pytest.mark.parametrize(
    ("generation_prompt", "expected"),
    [
        ("{%- endif -%}", ([1, 57, 34, 25, 7, 4], True)),  # does not open the thinking: <think> appended
        ("{{- '<think></think>' -}}{%- endif -%}", ([1, 57, 34, 25, 7, 4, 5], False)),  # closed it: answer only
        ("{{- '<think>\n' -}}{%- endif -%}", ([1, 57, 34, 25, 7, 4, 7], True)),  # opens, then whitespace
    ],
)
def test_templates_that_do_not_open_or_close_the_thinking(generation_prompt, expected):
    assert _rules(generation_prompt).chat(USER) == expected


def test_chat_refuses_control_text_and_a_chat_without_user(rules):
    with pytest.raises(PromptError, match=r"messages\.0\.content: .*\['<eos>', '<think>'\]") as info:
        rules.chat([{"role": "user", "content": "a<eos>b<think>"}])
    assert (info.value.param, info.value.code) == ("messages.0.content", "special_token")
    with pytest.raises(PromptError, match="at least one message with role 'user'") as info:
        rules.chat([{"role": "system", "content": "x"}])
    assert info.value.param == "messages"


def test_completion_thinks_only_after_the_open_marker(rules):
    assert rules.completion("Q:1\n<think>\n") == ([57, 34, 25, 7, 4, 7], True)  # trailing whitespace aside
    assert rules.completion("a1") == ([73, 25], False)
    assert rules.completion([1, 57, 4]) == ([1, 57, 4], True)
    assert rules.completion([1, 57, 5]) == ([1, 57, 5], False)
    assert rules.completion([]) == ([], False)
    with pytest.raises(PromptError, match=r"prompt\.1: token ids \[112, 500\] outside \[0, 112\)") as info:
        rules.completion([1, 112, 500], "prompt.1")
    assert info.value.param == "prompt.1"


def test_visible_text_drops_special_tokens_and_marker_strings(rules):
    assert rules.visible_text([1, 57, 4, 34, 5, 25, 2]) == "Q:1"
    # markers that are plain strings, not tokens: found in user text, appended as ids, removed from output
    plain = _rules(markers=ReasoningMarkers(think_open="[T]", think_close="[/T]"))
    assert plain.forbidden("a[/T]b<eos>") == ["<eos>", "[/T]"]
    assert plain.chat(USER) == ([1, 57, 34, 25, 7, 4, 67, 60, 69], True)  # '[' 67, 'T' 60, ']' 69
    assert plain.completion("a [T] ") == ([73, 8, 67, 60, 69, 8], True)
    assert plain.visible_text(plain.tokenizer.encode("<bos>x[T]y[/T]z<eos>")) == "xyz"


# ---------------------------------------------------------------------- tools and template variables
TOOLS_TEMPLATE = (  # in the style of Hermes / Qwen templates: the tools listed first, calls as <tool_call> blocks
    "{{- bos_token -}}"
    "{%- if tools -%}{%- for t in tools -%}{{- t.function.name + ':' + t.function.description + '\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined -%}"
    "{%- for c in m.tool_calls -%}{{- '<tool_call>' + c.function.name + (c.function.arguments | tojson) -}}"
    "{%- endfor -%}{{- eos_token -}}"
    "{%- elif m.role == 'tool' -%}{{- '[' + m.content + ']' -}}"
    "{%- else -%}{{- m.content -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' -}}{%- endif -%}{%- endif -%}"
)
TOOL = {"type": "function", "function": {"name": "add", "description": "sum", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
EXCHANGE = [*USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "3"}]


def _text(rules: PromptRules, *args) -> str:
    return rules.tokenizer.decode(rules.chat(*args)[0])


def test_tools_and_calls_go_through_a_template_that_renders_them():
    from components.serving.tools import tool_format

    hf = build_demo_tokenizer()
    hf.chat_template = TOOLS_TEMPLATE
    rules = PromptRules(TextTokenizer(hf), tool_format("hermes"))
    assert _text(rules, EXCHANGE, [TOOL]) == '<bos>add:sum\nQ:1\n<tool_call>add{"a": 1}<eos>[3]<think>'
    # chat_template_kwargs reach the template: this one closes the thinking when told not to think
    assert rules.chat(USER, None, {"enable_thinking": False}) == ([1, 57, 34, 25, 7, 4, 5], False)


def test_calls_are_folded_into_content_for_a_template_that_ignores_them():
    """The demo template renders an assistant turn's content only: the call is written in the tool format."""
    from components.serving.tools import tool_format

    for name, written in (
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'),
        ("nemotron_v2", '<TOOLCALL>[{"name": "add", "arguments": {"a": 1}}]</TOOLCALL>'),
    ):
        rules = PromptRules(TextTokenizer(build_demo_tokenizer()), tool_format(name))
        assert _text(rules, EXCHANGE) == f"<bos>Q:1\n<think></think>{written}<eos>3<think>"


def test_control_text_in_tools_or_template_variables_and_reserved_variables_are_refused(rules):
    bad_tool = {"type": "function", "function": {"name": "add", "description": "a<eos>"}}
    with pytest.raises(PromptError) as info:
        rules.chat(USER, [bad_tool])
    assert (info.value.param, info.value.code) == ("tools.0.function.description", "special_token")
    with pytest.raises(PromptError, match=r"chat_template_kwargs\.note: must not contain"):
        rules.chat(USER, None, {"note": "<think>"})
    for key in ("add_generation_prompt", "messages", "bos_token"):
        with pytest.raises(PromptError, match=f"chat_template_kwargs.{key}: set by the server") as info:
            rules.chat(USER, None, {key: True})
        assert info.value.param == f"chat_template_kwargs.{key}"


def test_rendering_with_tools_and_variables_equals_apply_chat_template():
    """The compiled-template fast path against transformers' ``apply_chat_template`` with tools and kwargs."""
    hf = build_demo_tokenizer()
    hf.chat_template = TOOLS_TEMPLATE
    tok = TextTokenizer(hf)
    assert tok._compiled is not None  # the fast path is the one under test
    for kwargs in ({}, {"enable_thinking": False}):
        for tools in (None, [TOOL]):
            reference = hf.apply_chat_template(
                EXCHANGE, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
            )
            assert tok.render_chat(EXCHANGE, True, tools, kwargs) == reference
