"""OpenAI response bodies, stream chunks and error objects."""

from __future__ import annotations

import json
import time
import uuid

from inference.engine import Finished, Usage

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def models_list(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_name, created)]}


def model_card(model_name: str, created: int) -> dict:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "expertpack"}


class CompletionShape:
    """The payloads of one request, chat or text completion, sharing its id, model and creation time."""

    def __init__(self, *, chat: bool, model: str, include_usage: bool = False):
        self.chat = chat
        self.id = new_completion_id(chat)
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def _envelope(self, object_type: str) -> dict:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model}

    def full(self, finished: Finished) -> dict:
        """The non-streaming response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": finished.text},
                      "logprobs": None, "finish_reason": finished.finish_reason}
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": finished.text, "logprobs": None, "finish_reason": finished.finish_reason}
            body = self._envelope("text_completion")
        return {**body, "choices": [choice], "usage": finished.usage.as_dict()}

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self._envelope("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def opening_chunks(self) -> list[dict]:
        """Chunks sent before any text: the assistant role, for chat."""
        if not self.chat:
            return []
        return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})]

    def text_chunk(self, text: str) -> dict:
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

    def closing_chunks(self, finish_reason: str, usage: Usage) -> list[dict]:
        """The finish_reason chunk, then (include_usage) a chunk with no choices and the usage."""
        if self.chat:
            final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            final = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        chunks = [self._chunk(final)]
        if self.include_usage:
            chunks.append({**self._envelope("chat.completion.chunk" if self.chat else "text_completion"),
                           "choices": [], "usage": usage.as_dict()})
        return chunks
