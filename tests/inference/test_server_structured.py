"""Structured output through a live `inference serve` and the official openai client: with random
weights the model has no idea of JSON, so every reply that parses and validates does so because
the grammar masked everything else.

Validation uses `jsonschema` (a test dependency), not a check of our own. The `server` and
`client` fixtures: test_server_fixtures.py.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from test_server_fixtures import MODEL

CHAT = [{"role": "user", "content": "Describe the weather as JSON."}]
REQUESTS = 50
MAX_TOKENS = 160


def _value_schema(rng: random.Random, depth: int) -> dict:
    """A bounded schema: every string, array and number has a length a random walk cannot exceed."""
    kinds = ["string", "integer", "boolean", "enum", "null", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["north", "south", "east", "west", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "array":
        item = rng.choice([{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9},
                           {"type": "string", "maxLength": 3}])
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        return _object_schema(rng, depth + 1)
    return {"type": kind}


def _object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["city", "temp", "wind", "sky", "rain", "hours", "alerts", "ok"], rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _json_schema(schema: dict, name: str = "weather") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_fifty_seeded_json_schema_replies_all_validate(client):
    rng = random.Random(14)
    failures = []
    for seed in range(REQUESTS):
        schema = _object_schema(rng)
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, seed=seed,
                                               temperature=1.0, response_format=_json_schema(schema))
        choice = reply.choices[0]
        try:
            assert choice.finish_reason == "stop", choice.finish_reason
            jsonschema.validate(json.loads(choice.message.content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((seed, schema, choice.message.content, exc))
    assert failures == [], failures


def test_json_schema_streams_and_validates(client):
    schema = _object_schema(random.Random(3))
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, seed=5,
                                            response_format=_json_schema(schema), stream=True)
    pieces, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    jsonschema.validate(json.loads("".join(pieces)), schema)
    assert reasons[-1] == "stop"


def test_greedy_json_schema_is_deterministic_and_valid(client):
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "grey"]},
                                               "temp": {"type": "integer", "minimum": -30, "maximum": 40}},
              "required": ["sky", "temp"], "additionalProperties": False}
    texts = {client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                            response_format=_json_schema(schema)).choices[0].message.content
             for _ in range(2)}
    assert len(texts) == 1
    jsonschema.validate(json.loads(texts.pop()), schema)


def test_json_object_gives_an_object(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, seed=1,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_completions_take_a_response_format_too(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.completions.create(model=MODEL, prompt="The weather:", max_tokens=20, seed=2,
                                      extra_body={"response_format": _json_schema(schema)})
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


BAD_FORMATS = [
    (_json_schema({"type": "objectx"}), "response_format.json_schema.schema"),
    (_json_schema({"type": "string", "format": "no-such-format"}), "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "w"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": {}, "shape": 1}},
     "response_format.json_schema.shape"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_object", "json_schema": {}}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "text", "regex": "a+"}, "response_format.regex"),
    ("json", "response_format"),
]


@pytest.mark.parametrize("fmt, param", BAD_FORMATS, ids=[p + "-" + str(i) for i, (_, p) in enumerate(BAD_FORMATS)])
def test_bad_response_formats_get_a_400_naming_the_field(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body={"response_format": fmt})
    assert caught.value.body["param"] == param, caught.value.body


def test_min_tokens_with_a_schema_is_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                       response_format={"type": "json_object"}, extra_body={"min_tokens": 3})
    assert caught.value.body["param"] == "min_tokens"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_top_level_scalar_ends_the_choice_with_or_without_eos(client, ignore_eos):
    schema = {"type": "integer", "minimum": 0, "maximum": 5000}
    for seed in range(3):
        choice = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, seed=seed,
                                                response_format=_json_schema(schema),
                                                extra_body={"ignore_eos": ignore_eos}).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
