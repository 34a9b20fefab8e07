"""Grammar-constrained decoding: llguidance's matcher turns a grammar into a token mask per step.

A request's grammar (a JSON schema, or a Lark grammar for tool calls) is compiled to llguidance's
grammar text when the request is parsed, so that a schema the library cannot honour is a 400
naming the field before anything is queued; SamplingParams carries that text. At generation time
`TokenConstraint` holds the matcher of one choice: `mask` sets every token the grammar does not
allow next to -inf, `advance` feeds it the sampled token, and `finished` says the grammar is
complete (the choice then ends with finish_reason "stop").

llguidance was chosen over xgrammar and outlines: it is one abi3 wheel with no dependencies (one
file for every CPython >= 3.9 on linux x86_64, installable on a machine without a network),
computes a mask in well under a millisecond for large vocabularies, and reads Hugging Face
`tokenizers` JSON directly, special tokens included. xgrammar needs a wheel per Python version
plus apache-tvm-ffi and triton; outlines pulls in outlines-core, pydantic, jinja and more.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping

import torch

from inference.engine.errors import InvalidRequestError

# what json.dumps writes by default, and what chat models learned: ", " and ": ", no other whitespace
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}


def _matcher_class(param: str):
    # imported on first use: a machine without llguidance still serves every other request
    try:
        from llguidance import LLMatcher
    except ImportError as exc:
        raise InvalidRequestError(f"{param}: structured output needs the llguidance package, which this server "
                                  f"does not have ({exc})", param=param) from exc
    return LLMatcher


def _checked(grammar: str, param: str) -> str:
    failed, messages = _matcher_class(param).validate_grammar_with_warnings(grammar)
    if failed:
        raise InvalidRequestError(f"{param}: {'; '.join(messages)}", param=param)
    return grammar


def json_schema_grammar(schema: Mapping[str, object], *, param: str) -> str:
    """llguidance's grammar for JSON values matching `schema`; a schema it cannot honour (an unknown
    type, an unsupported keyword or format) is refused naming `param`."""
    try:
        grammar = _matcher_class(param).grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from exc
    return _checked(grammar, param)


def lark_grammar(lark: str, *, param: str) -> str:
    """llguidance's grammar for a Lark grammar (llguidance's dialect: `%json {...}` embeds a schema,
    `<[id]>` matches one token by id)."""
    return _checked(_matcher_class(param).grammar_from_lark(lark), param)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, end_ids: tuple[int, ...]):
    from llguidance import LLTokenizer

    # the Rust side reads the tokenizers JSON itself (~1 s for a 150k vocabulary): once per tokenizer
    backend = tokenizer.backend_tokenizer
    if backend is None:
        raise InvalidRequestError("structured output needs a fast (tokenizers) tokenizer; this model has none",
                                  param="response_format")
    return LLTokenizer(backend.to_str(), eos_token=list(end_ids))


class GrammarError(RuntimeError):
    """Decoding left the grammar: no token of the vocabulary can continue it, or a token it
    forbids was taken (a bug: the mask comes before every draw). The engine fails the request."""


class TokenConstraint:
    """The grammar state of one choice: which tokens may come next, fed each sampled token.

    `end_ids` are the tokens that end the choice (EOS, stop token ids): the grammar allows them
    once it accepts. Tokens past the tokenizer's vocabulary (a wider lm_head) are never allowed.
    """

    def __init__(self, tokenizer, grammar: str, end_ids: Iterable[int]):
        ends = tuple(sorted(set(end_ids))) or (int(tokenizer.eos_token_id),)
        self._tokenizer = _ll_tokenizer(tokenizer, ends)
        self._matcher = _matcher_class("response_format")(self._tokenizer, grammar)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the request's grammar does not compile: {self._matcher.get_error()}",
                                      param="response_format")
        self._words = torch.empty(((self._tokenizer.vocab_size + 31) // 32,), dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """[tokenizer vocab] bool on the CPU: the tokens the grammar allows next."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        bits = (self._words.unsqueeze(-1) >> self._shifts) & 1  # [W, 32], bit i of word w is token 32w + i
        return bits.flatten()[:self._tokenizer.vocab_size].bool()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar forbids next set to -inf (a new tensor)."""
        allowed = self.allowed()
        vocab = int(logits.shape[-1])
        keep = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, allowed.numel())
        keep[:n] = allowed[:n]
        if not bool(keep.any()):
            raise GrammarError(f"the grammar allows no token of this model's {vocab}: "
                                      f"{self._matcher.get_error() or 'its vocabulary cannot spell what comes next'}")
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} was sampled against the grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but an end token could follow."""
        return self._matcher.is_stopped()
