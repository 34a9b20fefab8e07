"""Tool-call formats alone: calls rendered by the assistant-turn part of each family's published chat
template read back by the parser, and the forcing grammar's output (sampled from random logits
over a tokenizer that has the format's marker tokens) read back too."""

from __future__ import annotations

import json

import jinja2
import jsonschema
import pytest
import torch

from inference.engine import InvalidRequestError
from inference.engine.constraints import TokenConstraint, lark_grammar
from inference.server.tool_formats import DeepSeekFormat, DsmlFormat, HermesFormat, KimiFormat, ToolCall, format_of
from inference.server.tools import ToolPlan, ToolRequest, ToolStream, _literal, plan_tools, split_reply
from packtools.tokenizer_synth import build_tokenizer

# the assistant tool-call part of each template, as the model repositories publish it
QWEN3 = """{{ content }}{% for tool_call in tool_calls %}{% if loop.first and content or not loop.first %}\n{% endif %}\
<tool_call>\n{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}\n\
</tool_call>{% endfor %}"""
DEEPSEEK_V3 = """{{ content }}<｜tool▁calls▁begin｜>{% for tool in tool_calls %}{% if not loop.first %}\n{% endif %}\
<｜tool▁call▁begin｜>{{ tool['type'] }}<｜tool▁sep｜>{{ tool['function']['name'] }}\n```json\n\
{{ tool['function']['arguments'] | tojson }}\n```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>"""
DEEPSEEK_V31 = """{{ content }}<｜tool▁calls▁begin｜>{% for tool in tool_calls %}<｜tool▁call▁begin｜>\
{{ tool['function']['name'] }}<｜tool▁sep｜>{{ tool['function']['arguments'] | tojson }}<｜tool▁call▁end｜>\
{% endfor %}<｜tool▁calls▁end｜>"""
KIMI_K2 = """{{ content }}<|tool_calls_section_begin|>{% for tool_call in tool_calls %}<|tool_call_begin|>\
{{ tool_call['id'] }}<|tool_call_argument_begin|>{{ tool_call['function']['arguments'] | tojson }}\
<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>"""
# DeepSeek V3.2 and V4 ship their encoding as Python (encoding_dsv4.py); this writes what it writes
DSML = """{{ content }}<｜DSML｜BLOCK>\n{% for call in tool_calls %}<｜DSML｜invoke name="{{ call.function.name }}">\n\
{% for k, v in call.function.arguments.items() %}<｜DSML｜parameter name="{{ k }}" \
string="{{ 'true' if v is string else 'false' }}">{{ v if v is string else v | tojson }}</｜DSML｜parameter>\n\
{% endfor %}</｜DSML｜invoke>\n{% endfor %}</｜DSML｜BLOCK>"""
FORMATS = {"qwen3": (QWEN3, HermesFormat()), "deepseek_v3": (DEEPSEEK_V3, DeepSeekFormat(fenced=True)),
           "deepseek_v31": (DEEPSEEK_V31, DeepSeekFormat(fenced=False)), "kimi_k2": (KIMI_K2, KimiFormat()),
           "deepseek_v32": (DSML.replace("BLOCK", "function_calls"), DsmlFormat(block="function_calls")),
           "deepseek_v4": (DSML.replace("BLOCK", "tool_calls"), DsmlFormat())}
CALLS = [{"id": "functions.weather:0", "type": "function",
          "function": {"name": "weather", "arguments": {"city": "Oslo", "days": 3}}},
         {"id": "functions.clock:1", "type": "function", "function": {"name": "clock", "arguments": {}}}]
TOOLS = [{"name": "weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": False}},
         {"name": "clock", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]


def render(template: str, content: str, calls: list[dict]) -> str:
    return jinja2.Environment().from_string(template).render(content=content, tool_calls=calls)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("content", ["", "Let me check. "])
def test_calls_rendered_by_the_template_read_back(name, content):
    template, fmt = FORMATS[name]
    assert format_of(template).name == fmt.name
    parsed_content, calls = fmt.parse(render(template, content, CALLS))
    assert parsed_content.strip() == content.strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
    if name == "kimi_k2":
        assert [c.id for c in calls] == ["functions.weather:0", "functions.clock:1"]


@pytest.mark.parametrize("name", FORMATS)
def test_malformed_or_absent_calls_are_content(name):
    template, fmt = FORMATS[name]
    assert fmt.parse("just words") is None
    broken = render(template, "", CALLS[:1]).replace("3", "3}")  # the arguments (or a value) no longer JSON
    assert fmt.parse(broken) is None


def test_hermes_reads_a_call_cut_before_its_closing_tag():
    assert HermesFormat().parse('<tool_call>\n{"name": "clock", "arguments": {}}') == ("", [ToolCall("clock", "{}")])


def test_dsml_is_recognized_with_either_bar_and_block():
    ascii_v4 = format_of(DSML.replace("BLOCK", "tool_calls").replace("｜", "|"))
    assert (ascii_v4.start, format_of(DSML.replace("BLOCK", "function_calls")).start) == (
        "<|DSML|tool_calls>", "<｜DSML｜function_calls>")
    text = render(DSML.replace("BLOCK", "tool_calls").replace("｜", "|"), "", CALLS)
    assert [c.name for c in ascii_v4.parse(text)[1]] == ["weather", "clock"]


def test_a_template_without_tool_calls_has_no_format():
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer(512)
    markers = [DeepSeekFormat.start, DeepSeekFormat.CALL, DeepSeekFormat.SEP, DeepSeekFormat.END,
               DeepSeekFormat.CLOSE, KimiFormat.start, KimiFormat.CALL, KimiFormat.ARGS, KimiFormat.END,
               KimiFormat.CLOSE]  # special tokens in DeepSeek's and Kimi's vocabularies; Qwen3's tags are text here
    tok.add_special_tokens({"additional_special_tokens": markers})
    return tok


def forced(tokenizer, fmt, tools, many: bool, seed: int) -> str:
    grammar = TokenConstraint(tokenizer, lark_grammar(fmt.lark(tools, many, _literal(tokenizer)), param="tool_choice"),
                              [2])
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(400):
        logits = grammar.mask(torch.randn(len(tokenizer), generator=generator))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        grammar.advance(token)
        if token == 2:
            break
        tokens.append(token)
        if grammar.finished:
            break
    assert grammar.finished
    return tokenizer.decode(tokens, skip_special_tokens=False)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_the_forcing_grammar_gives_calls_the_parser_reads(tokenizer, name, many, seed):
    _, fmt = FORMATS[name]
    text = forced(tokenizer, fmt, TOOLS, many, seed)
    content, calls = fmt.parse(text)
    assert content == "" and calls and (many or len(calls) == 1), text
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_named_function_is_the_only_one_the_grammar_allows(tokenizer):
    text = forced(tokenizer, HermesFormat(), TOOLS[1:], False, seed=0)
    assert [c.name for c in HermesFormat().parse(text)[1]] == ["clock"]


def test_the_stream_holds_back_only_what_may_be_a_call():
    plan = ToolPlan(HermesFormat(), parallel=True, grammar=None)
    text = "Sure <tool_ it is.\n" + render(QWEN3, "", CALLS)
    stream = ToolStream(plan)
    sent = "".join(stream.feed(ch) for ch in text)
    assert sent == "Sure <tool_ it is.\n"
    content, calls = stream.finish()
    assert content == "" and [c.name for c in calls] == ["weather", "clock"]
    plain = ToolStream(plan)
    assert "".join(plain.feed(ch) for ch in "no calls <tool") == "no calls "
    assert plain.finish() == ("<tool", [])


def test_parallel_false_keeps_the_first_call():
    plan = ToolPlan(HermesFormat(), parallel=False, grammar=None)
    content, calls = split_reply(plan, render(QWEN3, "", CALLS))
    assert content is None and [c.name for c in calls] == ["weather"]


def test_a_template_that_renders_no_tools_is_refused(tokenizer):
    request = ToolRequest(({"type": "function", "function": {"name": "clock"}},), "auto", None, True)
    with pytest.raises(InvalidRequestError) as caught:
        plan_tools(tokenizer, request)  # the synthetic tokenizer's template never reads `tools`
    assert caught.value.param == "tools"
