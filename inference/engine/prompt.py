"""Prompts to token ids: raw completions prompts, and chat messages through the tokenizer's template."""

from __future__ import annotations

from inference.engine.errors import InvalidRequestError


def encode_completion_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    """A text prompt is tokenized with the tokenizer's special tokens (BOS); a token list is taken as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    return [int(t) for t in prompt]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text the tokenizer's chat template makes of `messages`, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                  param="messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises whatever the template raises (raise_exception, TypeError...)
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    # the template writes any BOS itself; adding special tokens again would double it
    return list(tokenizer(render_chat(tokenizer, messages), add_special_tokens=False).input_ids)
