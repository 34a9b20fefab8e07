"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`: checked, rendered through the model's
chat template, and the model's tool calls read back (inference.server.tool_formats).

tool_choice "none": the tools are rendered (the model sees what exists, as vLLM does) and the
reply is plain content. "auto" (the default with tools): the reply's tool calls, if the model
writes any in its format, become `tool_calls` and finish_reason "tool_calls". "required" or a
named function: decoding is constrained by a grammar of the format, so the reply is that call.
parallel_tool_calls false: one call at most (the grammar allows one; "auto" keeps the first).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from inference.engine import InvalidRequestError
from inference.engine.constraints import lark_grammar
from inference.engine.prompt import template_variables
from inference.server.tool_formats import ToolCall, ToolFormat, format_of
from servicekit.echo import shown

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule, and the dots MCP tools use
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
CHOICES = ("none", "auto", "required")


def _refuse(param: str, message: str):
    raise InvalidRequestError(f"'{param}' {message}", param=param)


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]  # {"type": "function", "function": {...}}, what chat templates read
    choice: str  # none, auto, required, or "function" (named)
    named: str | None
    parallel: bool

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools if self.named is None or t["function"]["name"] == self.named]


def _tool(i: int, tool) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        _refuse(param, f"must be {{\"type\": \"function\", \"function\": {{...}}}}, got {shown(tool)}")
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        _refuse(f"{param}.{extra[0]}", "is not a tool key this server knows")
    function = tool["function"]
    unknown = sorted(set(function) - FUNCTION_KEYS)
    if unknown:
        _refuse(f"{param}.function.{unknown[0]}", "is not a function key this server knows")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        _refuse(f"{param}.function.name", f"must be 1-64 letters, digits, '_', '.' or '-', got {shown(name)}")
    checks = (("description", str, "a string"), ("parameters", dict, "a JSON schema object"), ("strict", bool,
                                                                                                 "a boolean"))
    for key, kind, expected in checks:
        if function.get(key) is not None and not isinstance(function[key], kind):
            _refuse(f"{param}.function.{key}", f"must be {expected}, got {shown(function[key])}")
    kept = {k: v for k, v in function.items() if v is not None and k != "strict"}
    return {"type": "function", "function": kept}


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and how to use them; None when it has none (tool_choice "none" at most)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        _refuse("tools", f"must be a list, got {shown(tools)}")
    tools = [_tool(i, t) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        _refuse("tools", f"names the function {duplicate!r} twice")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            _refuse("tool_choice", f"needs 'tools' (only 'none' without them), got {shown(choice)}")
        if parallel is not None:
            _refuse("parallel_tool_calls", "only goes with 'tools'")
        return None
    if parallel is not None and not isinstance(parallel, bool):
        _refuse("parallel_tool_calls", f"must be a boolean, got {shown(parallel)}")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or named not in names:
            _refuse("tool_choice", f"must name one of the tools ({', '.join(names)}), got {shown(choice)}")
        choice = "function"
    elif choice not in CHOICES:
        _refuse("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {shown(choice)}")
    return ToolRequest(tuple(tools), choice, named, True if parallel is None else parallel)


def _literal(tokenizer):
    """A marker's literal in a grammar: the token itself where the vocabulary has it as one."""
    added = tokenizer.get_added_vocab()

    def literal(text: str) -> str:
        return f"<[{added[text]}]>" if text in added else json.dumps(text)
    return literal


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this model: the format to read calls back in, the grammar
    that forces one (None unless tool_choice asks for it)."""

    format: ToolFormat
    parallel: bool
    grammar: str | None


def plan_tools(tokenizer, request: ToolRequest) -> ToolPlan | None:
    """Check that this model's template renders tools in a format this server reads back."""
    if "tools" not in template_variables(tokenizer):
        _refuse("tools", "cannot be used with this model: its chat template does not render tools")
    if not request.parses:
        return None
    fmt = format_of(tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None)
    if fmt is None:
        _refuse("tools", "cannot be used with this model: its chat template writes tool calls in no format this "
                         "server reads back (Qwen3's <tool_call>, DeepSeek's tool-call tokens or DSML, Kimi's sections); "
                         "tool_choice 'none' renders them without reading calls back")
    grammar = None
    if request.choice in ("required", "function"):
        lark = fmt.lark(request.functions(), request.parallel and request.choice == "required", _literal(tokenizer))
        grammar = lark_grammar(lark, param="tool_choice")
    return ToolPlan(fmt, request.parallel, grammar)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dicts(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's tool_calls; the model's own ids where it wrote them (Kimi), unless one repeats."""
    dicts, seen = [], set()
    for c in calls:
        identifier = c.id if c.id and c.id not in seen else call_id()
        seen.add(identifier)
        dicts.append({"id": identifier, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
    return dicts


def split_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when only whitespace came before the calls) and its tool calls."""
    parsed = plan.format.parse(text)
    if parsed is None:
        return text, []
    content, calls = parsed
    return (content if content.strip() else None), (calls if plan.parallel else calls[:1])


class ToolStream:
    """One streamed choice: passes content through until the format's opening marker (holding back a
    tail that may be its beginning), then holds the rest to read the calls from at the end."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._held = ""
        self._calling = False

    def feed(self, text: str) -> str:
        """The part of `text` that is content for sure."""
        text = self._held + text
        if not self._calling:
            start = self.plan.format.start
            at = text.find(start)
            if at >= 0:
                self._calling = True
            else:
                at = next((len(text) - k for k in range(min(len(start) - 1, len(text)), 0, -1)
                           if start.startswith(text[-k:])), len(text))
            self._held = text[at:]
            return text[:at]
        self._held = text
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left of the content, and the calls."""
        if not self._calling:
            return self._held, []
        content, calls = split_reply(self.plan, self._held)
        return (content or "") if not calls else "", calls
