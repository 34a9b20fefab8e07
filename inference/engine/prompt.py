"""Prompts to token ids: raw completions prompts, and chat messages through the tokenizer's template."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inference.engine.errors import InvalidRequestError

# arguments apply_chat_template takes itself: a request may not smuggle them in as template variables
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")  # transformers' own tag; not jinja
# a normalizer may fold a few characters into one (NFC composes a letter and its marks), so a token
# can stand for more characters than it spells: the length bound keeps this much room for that
NORMALIZATION_SLACK = 4


def encode_completion_prompt(tokenizer, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
    """A text prompt is tokenized with the tokenizer's special tokens (BOS); a token list is taken as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
    return [int(t) for t in prompt]


@functools.lru_cache(maxsize=4)
def longest_token_chars(tokenizer) -> int:
    """Characters of the longest entry of the vocabulary (added tokens included): no token of this
    tokenizer spells more (a byte-level token's spelling has one character per byte)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def prompt_chars_limit(tokenizer, context_length: int | None) -> int | None:
    """The most characters of text that could encode to fewer than `context_length` tokens, with
    room to spare (NORMALIZATION_SLACK); None when the context is unknown."""
    if context_length is None:
        return None
    return context_length * longest_token_chars(tokenizer) * NORMALIZATION_SLACK


def check_prompt_chars(tokenizer, context_length: int | None, chars: int, *, param: str) -> None:
    """Refuse a text far too long for the context before tokenizing it (which takes seconds for
    megabytes); what passes is tokenized and then checked exactly, in tokens."""
    limit = prompt_chars_limit(tokenizer, context_length)
    if limit is not None and chars > limit:
        raise InvalidRequestError(
            f"{param}: {chars} characters cannot fit this model's context of {context_length} tokens (the limit is "
            f"{limit} characters: {longest_token_chars(tokenizer)} at most per token, x{NORMALIZATION_SLACK}); "
            "refused before tokenizing", param=param, code="context_length_exceeded")


def text_chars(value) -> int:
    """Characters of every string in a JSON value (the messages of a chat request, say); a loop,
    not a recursion, however deep the value is nested."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return total


@functools.lru_cache(maxsize=8)
def _variables_of(template: str) -> frozenset[str]:
    source = _GENERATION_TAG.sub("", template)
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)))


def template_variables(tokenizer) -> frozenset[str]:
    """Every variable the tokenizer's chat template(s) read (named templates included)."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, Mapping) else [template] if template else []
    try:
        return frozenset().union(*(_variables_of(t) for t in templates))
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"this model's chat template does not parse: {exc}", param="messages") from exc


def check_template_kwargs(tokenizer, kwargs: Mapping[str, object], *, param: str = "chat_template_kwargs") -> None:
    """Refuse a template variable the template never reads: it would be silently ignored."""
    if not kwargs:
        return
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(f"{param}: {', '.join(reserved)} cannot be set through the template's variables",
                                  param=f"{param}.{reserved[0]}")
    unread = sorted(set(kwargs) - template_variables(tokenizer))
    if unread:
        raise InvalidRequestError(f"{param}: this model's chat template does not use {', '.join(unread)}",
                                  param=f"{param}.{unread[0]}" if param == "chat_template_kwargs" else param)


def render_chat(tokenizer, messages: list[dict], *, template_kwargs: Mapping[str, object] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None) -> str:
    """The prompt text the tokenizer's chat template makes of `messages`: ready for the assistant's turn,
    or (continue_final_message) ending inside the last message so that generation continues it."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                  param="messages")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true",
                                  param="continue_final_message")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             tools=tools or None, **dict(template_kwargs or {}))
    except Exception as exc:  # jinja raises whatever the template raises (raise_exception, TypeError...)
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc


def encode_chat(tokenizer, messages: list[dict], *, template_kwargs: Mapping[str, object] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    # the template writes any BOS itself; adding special tokens again would double it (vLLM's default too)
    text = render_chat(tokenizer, messages, template_kwargs=template_kwargs,
                       add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       tools=tools)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
