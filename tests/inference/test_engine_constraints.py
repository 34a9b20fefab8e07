"""TokenConstraint alone: a grammar's mask over the synthetic tokenizer, driven by random logits."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from inference.engine import InvalidRequestError
from inference.engine.constraints import GrammarError, TokenConstraint, json_schema_grammar, lark_grammar
from packtools.tokenizer_synth import build_tokenizer

EOS = 2
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "temp": {"type": "integer", "minimum": -9, "maximum": 40}},
          "required": ["city", "temp"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def walk(tokenizer, grammar: str, seed: int, vocab: int = 512, steps: int = 200) -> tuple[str, bool]:
    """Sample from random logits under the grammar until it completes or an end token comes."""
    constraint = TokenConstraint(tokenizer, grammar, [EOS])
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        logits = constraint.mask(torch.randn(vocab, generator=generator))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        constraint.advance(token)
        if token == EOS:
            break
        tokens.append(token)
        if constraint.finished:
            break
    return tokenizer.decode(tokens), constraint.finished


@pytest.mark.parametrize("seed", range(10))
def test_random_walks_under_a_schema_validate(tokenizer, seed):
    text, finished = walk(tokenizer, json_schema_grammar(SCHEMA, param="p"), seed)
    assert finished
    jsonschema.validate(json.loads(text), SCHEMA)
    assert ", " in text and '": ' in text  # json.dumps' separators, and no other whitespace


def test_a_wider_lm_head_never_gets_its_extra_tokens(tokenizer):
    constraint = TokenConstraint(tokenizer, json_schema_grammar({"type": "boolean"}, param="p"), [EOS])
    logits = torch.zeros(600)
    logits[512:] = 1e9  # the model would pick one of them
    masked = constraint.mask(logits)
    assert torch.isinf(masked[512:]).all()
    allowed = tokenizer.convert_ids_to_tokens(torch.nonzero(torch.isfinite(masked)).flatten().tolist())
    assert allowed and all("true".startswith(t) or "false".startswith(t) for t in allowed), allowed


def test_lark_grammar_with_an_embedded_schema(tokenizer):
    grammar = lark_grammar('start: "<call>" obj "</call>"\nobj: %json ' + json.dumps(SCHEMA), param="p")
    text, finished = walk(tokenizer, grammar, seed=3)
    assert finished and text.startswith("<call>") and text.endswith("</call>")
    jsonschema.validate(json.loads(text[len("<call>"):-len("</call>")]), SCHEMA)


@pytest.mark.parametrize("schema, message", [
    ({"type": "objectx"}, "Invalid type"),
    ({"type": "string", "format": "nonsense"}, "Unknown format"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, ""),
])
def test_schemas_it_cannot_honour_name_the_param(schema, message):
    with pytest.raises(InvalidRequestError) as caught:
        json_schema_grammar(schema, param="response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema" and message in caught.value.message


def test_a_bad_lark_grammar_names_the_param():
    with pytest.raises(InvalidRequestError) as caught:
        lark_grammar("start: (", param="tool_choice")
    assert caught.value.param == "tool_choice"


def test_a_token_the_grammar_forbids_fails_with_the_grammar_s_error(tokenizer):
    constraint = TokenConstraint(tokenizer, json_schema_grammar(SCHEMA, param="response_format"), [EOS])
    masked = constraint.mask(torch.zeros(512))
    forbidden = int(torch.nonzero(masked == float("-inf"))[0])
    with pytest.raises(GrammarError, match=f"token {forbidden} was sampled against the grammar"):
        constraint.advance(forbidden)
