"""How the models we serve write tool calls, read back from the generated text, and the grammar
that forces one (tool_choice "required" or a named function).

Each format is recognized by what the model's chat template writes for an assistant's tool calls:
- Qwen3 (Hermes style): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call;
- DeepSeek V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; DeepSeek V3.1 drops the `function` and the fence:
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`;
- Kimi K2 (and Kimi Linear, K3): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
  <|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>`;
- DeepSeek V3.2 and V4 (DSML): `<｜DSML｜tool_calls>` (V3.2: `function_calls`) around
  `<｜DSML｜invoke name="NAME">` blocks of `<｜DSML｜parameter name="P" string="true|false">VALUE
  </｜DSML｜parameter>`, VALUE raw text when string="true", JSON otherwise. DeepSeek ships this one as
  Python (encoding_dsv4.py), not as a template: it is read back where a template (a GGUF's, an
  operator's) writes it.
"""

from __future__ import annotations

import dataclasses
import json
import re

from inference.engine.constraints import JSON_OPTIONS


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI returns it
    id: str | None = None  # the model's own id for the call (Kimi writes one)


def _arguments(text: str) -> str | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _schema(parameters: dict) -> dict:
    return {**parameters, "x-guidance": JSON_OPTIONS} if parameters else {"type": "object", "x-guidance": JSON_OPTIONS}


class ToolFormat:
    name = ""
    start = ""  # what opens the tool calls: content is the text before it

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) when `text` holds well-formed tool calls after its content; None otherwise."""
        at = text.find(self.start)
        if at < 0:
            return None
        calls = self._calls(text[at:])
        return (text[:at], calls) if calls else None

    def _calls(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def lark(self, tools: list[dict], many: bool, token) -> str:
        """A Lark grammar (llguidance's dialect) for one call, or one or more when `many`, of `tools`;
        `token(text)` is the grammar's literal for a marker (a special token by id where it is one)."""
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name, start = "qwen3", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text):
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = json.loads(body)
            except (json.JSONDecodeError, RecursionError):
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            arguments = _arguments(json.dumps(call.get("arguments", {})))
            if arguments is None:
                return None
            calls.append(ToolCall(call["name"], arguments))
        return calls

    def lark(self, tools, many, token):
        variants = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                      "arguments": t.get("parameters") or {"type": "object"}},
                     "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        call_json = json.dumps({"anyOf": variants, "x-guidance": JSON_OPTIONS})
        repeat = ' ("\\n" call)*' if many else ""
        return (f"start: call{repeat}\n"
                f"call: {token('<tool_call>')} \"\\n\" args \"\\n\" {token('</tool_call>')}\n"
                f"args: %json {call_json}\n")


class DeepSeekFormat(ToolFormat):
    """V3 (`function` then the name and a ```json fence) when `fenced`, else V3.1 (name, raw JSON)."""

    start = "<｜tool▁calls▁begin｜>"
    CALL, SEP, END, CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(re.escape(CALL) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(END), re.DOTALL)
    _FENCED = re.compile(r"^\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.DOTALL)

    def __init__(self, fenced: bool):
        self.fenced = fenced
        self.name = "deepseek_v3" if fenced else "deepseek_v31"

    def _calls(self, text):
        calls = []
        for head, body in self._CALL.findall(text):
            if head.strip() == "function":
                match = self._FENCED.match(body)
                if match is None:
                    return None
                name, raw = match.group(1), match.group(2)
            else:
                name, raw = head.strip(), body
            arguments = _arguments(raw)
            if arguments is None or not name:
                return None
            calls.append(ToolCall(name, arguments))
        return calls

    def lark(self, tools, many, token):
        rules = []
        for i, t in enumerate(tools):
            schema = json.dumps(_schema(t.get("parameters") or {}))
            head = f"\"function\" {token(self.SEP)} {json.dumps(t['name'])} \"\\n```json\\n\" args{i} \"\\n```\"" \
                if self.fenced else f"{json.dumps(t['name'])} {token(self.SEP)} args{i}"
            rules.append(f"call{i}: {token(self.CALL)} {head} {token(self.END)}\nargs{i}: %json {schema}")
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        repeat = ' ("\\n" call)*' if many and self.fenced else " call*" if many else ""
        return (f"start: {token(self.start)} call{repeat} {token(self.CLOSE)}\n"
                f"call: {calls}\n" + "\n".join(rules) + "\n")


class KimiFormat(ToolFormat):
    name, start = "kimi_k2", "<|tool_calls_section_begin|>"
    CALL, ARGS, END, CLOSE = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                              "<|tool_calls_section_end|>")
    _CALL = re.compile(re.escape(CALL) + r"\s*([^<]+?)\s*" + re.escape(ARGS) + r"(.*?)" + re.escape(END), re.DOTALL)
    _ID = re.compile(r"^(?:functions\.)?(.+?)(?::\d+)?$")

    def _calls(self, text):
        calls = []
        for call_id, body in self._CALL.findall(text):
            name = self._ID.match(call_id).group(1)
            arguments = _arguments(body)
            if arguments is None:
                return None
            calls.append(ToolCall(name, arguments, call_id))
        return calls

    def lark(self, tools, many, token):
        rules = []
        for i, t in enumerate(tools):
            schema = json.dumps(_schema(t.get("parameters") or {}))
            rules.append(f"call{i}: {token(self.CALL)} {json.dumps('functions.' + t['name'] + ':')} /[0-9]/ "
                         f"{token(self.ARGS)} args{i} {token(self.END)}\nargs{i}: %json {schema}")
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        repeat = " call*" if many else ""
        return (f"start: {token(self.start)} call{repeat} {token(self.CLOSE)}\n"
                f"call: {calls}\n" + "\n".join(rules) + "\n")


class DsmlFormat(ToolFormat):
    """`bar` is DeepSeek's fullwidth ｜ (some templates write ASCII |); `block` is tool_calls (V4) or
    function_calls (V3.2)."""

    name = "deepseek_dsml"
    _TEMPLATE = re.compile(r"<([|｜])DSML\1(tool_calls|function_calls)>")

    def __init__(self, bar: str = "｜", block: str = "tool_calls"):
        self.bar, self.block = bar, block
        tag = re.escape(f"{bar}DSML{bar}")
        self.start = f"<{bar}DSML{bar}{block}>"
        self._invoke = re.compile(f'<{tag}invoke\\s+name="([^"]+)"\\s*>(.*?)</{tag}invoke>', re.DOTALL)
        self._param = re.compile(f'<{tag}parameter\\s+name="([^"]+)"\\s+string="(true|false)"\\s*>(.*?)'
                                 f'</{tag}parameter>', re.DOTALL)

    @classmethod
    def of(cls, template: str) -> DsmlFormat | None:
        match = cls._TEMPLATE.search(template)
        return cls(match.group(1), match.group(2)) if match else None

    def _calls(self, text):
        calls = []
        for name, body in self._invoke.findall(text):
            arguments = {}
            for param, is_string, value in self._param.findall(body):
                if is_string == "true":
                    arguments[param] = value
                else:
                    try:
                        arguments[param] = json.loads(value)
                    except (json.JSONDecodeError, RecursionError):
                        return None
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def _value(self, rule: str, spec) -> tuple[str, str, str | None]:
        """(string attribute, the value's grammar, its rule or None): a plain string property is raw
        text, as the model writes it; anything else is JSON matching its schema."""
        plain = isinstance(spec, dict) and spec.get("type") == "string" and set(spec) <= {
            "type", "description", "title", "maxLength"}
        if plain:
            limit = spec.get("maxLength")
            return "true", f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/", None
        return "false", rule, f"{rule}: %json {json.dumps({**(spec or {}), 'x-guidance': JSON_OPTIONS})}"

    def lark(self, tools, many, token):
        tag, lit = f"{self.bar}DSML{self.bar}", lambda text: json.dumps(text, ensure_ascii=False)
        rules = []
        for i, t in enumerate(tools):
            schema = t.get("parameters") or {}
            required = set(schema.get("required", ()))
            parts = []
            for j, (param, spec) in enumerate((schema.get("properties") or {}).items()):
                string, value, rule = self._value(f"value{i}_{j}", spec)
                if rule is not None:
                    rules.append(rule)
                opening = f'<{tag}parameter name={json.dumps(param)} string="{string}">'
                part = f"{lit(opening)} {value} {lit(f'</{tag}parameter>' + chr(10))}"
                parts.append(part if param in required else f"({part})?")
            invoke = f"<{tag}invoke name={json.dumps(t['name'])}>\n"
            rules.append(f"call{i}: {lit(invoke)} {' '.join(parts)} {lit(f'</{tag}invoke>')}")
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        repeat = f" ({lit(chr(10))} call)*" if many else ""
        return (f"start: {lit(self.start + chr(10))} call{repeat} {lit(f'{chr(10)}</{tag}{self.block}>')}\n"
                f"call: {calls}\n" + "\n".join(rules) + "\n")


def format_of(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes; None when it writes none this server knows."""
    template = chat_template or ""
    dsml = DsmlFormat.of(template)
    if dsml is not None:
        return dsml
    if KimiFormat.start in template:
        return KimiFormat()
    if DeepSeekFormat.start in template:
        return DeepSeekFormat(fenced="```json" in template)
    if HermesFormat.start in template:
        return HermesFormat()
    return None
