"""OpenAI's `response_format` to the grammar the engine constrains decoding with.

`text` (or no field) asks for nothing; `json_object` for any JSON object; `json_schema` for a JSON
value matching `json_schema.schema`, whatever `strict` says (a strict schema is matched the same
way, and a non-strict one is matched too, as vLLM does). A schema the grammar compiler cannot
honour is refused naming `response_format.json_schema.schema`.
"""

from __future__ import annotations

import re

from inference.engine import InvalidRequestError
from inference.engine.constraints import ANY_JSON_OBJECT, json_schema_grammar
from servicekit.echo import shown

SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def _refuse(param: str, message: str):
    raise InvalidRequestError(f"'{param}' {message}", param=param)


def response_format_grammar(body: dict) -> str | None:
    """The grammar a request's response_format asks for; None for plain text."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        _refuse("response_format", f"must be an object, got {shown(fmt)}")
    kind = fmt.get("type")
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra:
        _refuse(f"response_format.{extra[0]}", "is not a response_format key this server knows")
    if kind == "text" or kind == "json_object":
        if "json_schema" in fmt:
            _refuse("response_format.json_schema", f"only goes with type 'json_schema', not {shown(kind)}")
        return None if kind == "text" else json_schema_grammar(ANY_JSON_OBJECT, param="response_format")
    if kind != "json_schema":
        _refuse("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {shown(kind)}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        _refuse("response_format.json_schema", f"must be an object with a 'name' and a 'schema', got {shown(spec)}")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if unknown:
        _refuse(f"response_format.json_schema.{unknown[0]}", "is not a json_schema key this server knows")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        _refuse("response_format.json_schema.name", f"must be 1-64 letters, digits, '_' or '-', got {shown(name)}")
    for key, kind_ok, expected in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], kind_ok):
            _refuse(f"response_format.json_schema.{key}", f"must be {expected}, got {shown(spec[key])}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        _refuse("response_format.json_schema.schema", f"must be a JSON schema object, got {shown(schema)}")
    return json_schema_grammar(schema, param="response_format.json_schema.schema")
