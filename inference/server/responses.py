"""OpenAI response bodies, stream chunks and error objects."""

from __future__ import annotations

import json
import time
import uuid

from inference.engine import Finished, TextDelta, Usage
from inference.server.token_text import TokenTexts
from inference.server.tools import ToolPlan, ToolStream, split_reply, tool_call_dicts

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_completion_id(chat: bool, request_id: str | None = None) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"


def models_list(model_name: str, created: int, max_model_len: int | None = None) -> dict:
    return {"object": "list", "data": [model_card(model_name, created, max_model_len)]}


def model_card(model_name: str, created: int, max_model_len: int | None = None) -> dict:
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "expertpack"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len  # vLLM's extension: what the server allows
    return card


def _tool_reason(finish_reason: str) -> str:
    # a reply cut by max_tokens stays "length" even when its calls parsed
    return "tool_calls" if finish_reason == "stop" else finish_reason


class _ChoiceState:
    """What a stream has sent of one choice: logprob entries and (completions) the text offset."""

    def __init__(self, tools: ToolPlan | None = None):
        self.logprobs_sent = 0
        self.text_offset = 0
        self.completion_tokens = 0
        self.tool_stream = ToolStream(tools) if tools is not None else None


class CompletionShape:
    """The payloads of one request, chat or text completion, sharing its id, model and creation time.

    Choice i belongs to prompt i // n; usage counts each prompt once and every choice's tokens.
    """

    def __init__(self, *, chat: bool, model: str, include_usage: bool = False, continuous_usage: bool = False,
                 request_id: str | None = None, prompt_tokens: int = 0, choices: int = 1,
                 logprobs: int | None = None, token_texts: TokenTexts | None = None, tools: ToolPlan | None = None):
        self.chat = chat
        self.id = new_completion_id(chat, request_id)
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.token_texts = token_texts
        self.tools = tools  # chat: tool calls are read back from the text in this plan's format
        self._choices = [_ChoiceState(tools) for _ in range(choices)]

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, object_type: str) -> dict:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        return Usage(self.prompt_tokens, completion_tokens).as_dict()

    # --- logprobs ---------------------------------------------------------------------------

    def _logprobs(self, entries, state: _ChoiceState | None = None) -> dict | None:
        if self.logprobs is None:
            return None
        texts = self.token_texts
        if self.chat:
            def item(token_id: int, logprob: float) -> dict:
                text, raw = texts.text_and_bytes(token_id)
                return {"token": text, "logprob": logprob, "bytes": raw}
            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        offset = state.text_offset if state is not None else 0
        tokens, offsets = [], []
        for e in entries:
            text = texts.text(e.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)  # vLLM's offsets: into the completion, token by token
        if state is not None:
            state.text_offset = offset
        top = [{texts.text(t): lp for t, lp in ((e.token_id, e.logprob), *e.top)} for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": offsets}

    # --- whole responses --------------------------------------------------------------------

    def full(self, finished: list[Finished]) -> dict:
        """The non-streaming response of every choice's Finished."""
        choices = []
        for f in sorted(finished, key=lambda f: f.index):
            logprobs = self._logprobs(f.logprobs or ())
            if self.chat:
                message, reason = {"role": "assistant", "content": f.text}, f.finish_reason
                if self.tools is not None:
                    content, calls = split_reply(self.tools, f.text)
                    if calls:
                        message, reason = {"role": "assistant", "content": content,
                                           "tool_calls": tool_call_dicts(calls)}, _tool_reason(f.finish_reason)
                choices.append({"index": f.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": f.index, "text": f.text, "logprobs": logprobs,
                                "finish_reason": f.finish_reason})
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": choices, "usage": self.usage(sum(f.usage.completion_tokens for f in finished))}

    # --- stream chunks ----------------------------------------------------------------------

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self._envelope(self.object), "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = self.usage(sum(c.completion_tokens for c in self._choices))
        elif self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def opening_chunks(self) -> list[dict]:
        """Chunks sent before any text: each choice's assistant role, for chat."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self._choices))]

    def text_chunk(self, delta: TextDelta) -> dict | None:
        """The chunk of a delta; None when there is nothing to send yet (text held back as a possible tool call)."""
        state = self._choices[delta.index]
        state.completion_tokens = delta.completion_tokens
        text = delta.text if state.tool_stream is None else state.tool_stream.feed(delta.text)
        if not text and not delta.logprobs:
            return None
        logprobs = self._logprobs(delta.logprobs, state)
        state.logprobs_sent += len(delta.logprobs)
        if self.chat:
            return self._chunk({"index": delta.index, "delta": {"content": text}, "logprobs": logprobs,
                                "finish_reason": None})
        return self._chunk({"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": None})

    def finish_chunks(self, finished: Finished) -> list[dict]:
        """A choice's last chunks: content held back and tool calls (one chunk each, whole), then its
        finish_reason with the logprobs of tokens no delta carried (EOS...)."""
        state = self._choices[finished.index]
        state.completion_tokens = finished.usage.completion_tokens
        chunks, reason = [], finished.finish_reason
        if state.tool_stream is not None:
            content, calls = state.tool_stream.finish()
            if content:
                chunks.append(self._chunk({"index": finished.index, "delta": {"content": content}, "logprobs": None,
                                           "finish_reason": None}))
            for i, call in enumerate(tool_call_dicts(calls)):
                chunks.append(self._chunk({"index": finished.index, "delta": {"tool_calls": [{"index": i, **call}]},
                                           "logprobs": None, "finish_reason": None}))
            reason = _tool_reason(reason) if calls else reason
        logprobs = self._logprobs((finished.logprobs or ())[state.logprobs_sent:], state)
        if self.chat:
            final = {"index": finished.index, "delta": {}, "logprobs": logprobs, "finish_reason": reason}
        else:
            final = {"index": finished.index, "text": "", "logprobs": logprobs, "finish_reason": reason}
        return chunks + [self._chunk(final)]

    def usage_chunk(self) -> dict | None:
        """With include_usage: a last chunk with no choices and the whole request's usage."""
        if not self.include_usage:
            return None
        return {**self._envelope(self.object), "choices": [],
                "usage": self.usage(sum(c.completion_tokens for c in self._choices))}
