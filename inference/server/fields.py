"""Every request field of /v1/chat/completions and /v1/completions the server knows, and what it does
with each: honoured, kept as a tag (written to the access log), or refused with a 400 naming it
unless it holds the value that means "off". A field of the other endpoint only (`tools` sent to
/v1/completions, `suffix` to chat) is refused with a 400 naming it unless it is null. Fields outside
this catalogue are logged once per name and otherwise ignored (vLLM does the same);
docs/inference.md lists this table.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import threading
from collections.abc import Callable

log = logging.getLogger("inference.server")

HONOURED, TAG, REFUSED = "honoured", "tag", "refused"
CHAT, COMPLETIONS = "chat", "completions"
BOTH = frozenset({CHAT, COMPLETIONS})


def _null(value) -> bool:
    return value is None


def _off(value) -> bool:
    """null, false, 0, empty: the values clients send to mean "off"."""
    if value is None or value is False or (isinstance(value, numbers.Real) and value == 0):
        return True
    return isinstance(value, (str, list, dict)) and not value


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    status: str
    endpoints: frozenset[str]
    note: str
    accepted: Callable[[object], bool] | None = None  # refused fields: the values that ask for nothing

    def applies_to(self, chat: bool) -> bool:
        return (CHAT if chat else COMPLETIONS) in self.endpoints


def _honoured(name: str, note: str, endpoints=BOTH) -> Field:
    return Field(name, HONOURED, frozenset(endpoints), note)


def _refused(name: str, note: str, accepted=_off, endpoints=BOTH) -> Field:
    return Field(name, REFUSED, frozenset(endpoints), note, accepted)


FIELDS: tuple[Field, ...] = (
    # OpenAI
    _honoured("model", "must name the served model (404 otherwise)"),
    _honoured("messages", "roles system, developer, user, assistant (with `tool_calls`, `reasoning_content`), "
              "tool (with `tool_call_id`); text content parts only", {CHAT}),
    _honoured("prompt", "a string, a list of token ids, or a list of either (one choice set per prompt)",
              {COMPLETIONS}),
    _honoured("max_tokens", "capped by `--max-tokens`; default: the model's `max_new_tokens`, else the context left"),
    _honoured("max_completion_tokens", "same as `max_tokens`; wins over it", {CHAT}),
    _honoured("temperature", "[0, 2]; 0 is greedy"),
    _honoured("top_p", "(0, 1]"),
    _honoured("seed", "a 64-bit signed integer (400 outside [-2^63, 2^63 - 1]); same seed, same tokens; "
              "choice i of `n` uses seed + i"),
    _honoured("stop", "a string or a list of them; the text ends before the match"),
    _honoured("n", "choices generated together, as sequences of the running batch"),
    _honoured("stream", "server-sent events"),
    _honoured("stream_options", "`include_usage`; vLLM's `continuous_usage_stats`; `include_obfuscation` only false"),
    _honoured("presence_penalty", "[-2, 2], subtracted once from tokens already generated"),
    _honoured("frequency_penalty", "[-2, 2], subtracted per occurrence in the generated tokens"),
    _honoured("logit_bias", "token id -> [-100, 100], added to the logits"),
    _honoured("logprobs", "chat: true/false; completions: 0-20 most likely tokens per position"),
    _honoured("top_logprobs", "0-20, with `logprobs: true`", {CHAT}),
    _honoured("reasoning_effort", "passed to the chat template when it reads `reasoning_effort` (gpt-oss); "
              "400 otherwise", {CHAT}),
    Field("user", TAG, BOTH, "written to the access log"),
    Field("safety_identifier", TAG, frozenset({CHAT}), "written to the access log"),
    Field("metadata", TAG, frozenset({CHAT}), "written to the access log"),
    Field("prompt_cache_key", TAG, frozenset({CHAT}), "written to the access log (there is no prompt cache)"),
    _refused("prompt_cache_retention", "accepted as null, `in_memory` or `24h`: nothing is retained",
             lambda v: v in (None, "in_memory", "24h"), {CHAT}),
    _refused("service_tier", "accepted as null, `auto` or `default`: there is one tier",
             lambda v: v in (None, "auto", "default"), {CHAT}),
    _refused("store", "only false: nothing is stored", endpoints={CHAT}),
    _refused("modalities", "only `[\"text\"]`", lambda v: v is None or v == ["text"], {CHAT}),
    _honoured("response_format", "`text`, `json_object`, `json_schema` (any `strict`): grammar-constrained decoding "
              "(llguidance); a schema it cannot honour is a 400 naming `response_format.json_schema.schema` "
              "(completions: vLLM's extension)"),
    _honoured("tools", "functions rendered through the model's chat template (400 if it renders none); calls read "
              "back in the model's format (Qwen3 `<tool_call>`, DeepSeek V3/V3.1/DSML, Kimi K2) as `tool_calls`, streamed "
              "as `tool_calls` deltas, finish_reason `tool_calls`", {CHAT}),
    _honoured("tool_choice", "`none` (tools rendered, plain content), `auto` (default with tools), `required` or a "
              "named function (forced by grammar-constrained decoding); 400 without tools unless `none`", {CHAT}),
    _honoured("parallel_tool_calls", "false: one call at most (`auto` keeps the first); only with tools", {CHAT}),
    _refused("functions", "deprecated tool calling; not supported", endpoints={CHAT}),
    _refused("function_call", "deprecated tool calling; not supported", lambda v: v in (None, "none"), {CHAT}),
    _refused("audio", "audio output is not supported", endpoints={CHAT}),
    _refused("prediction", "predicted outputs are not supported", endpoints={CHAT}),
    _refused("web_search_options", "web search is not supported", _null, {CHAT}),
    _refused("verbosity", "not supported", _null, {CHAT}),
    _refused("moderation", "not supported", _null, {CHAT}),
    _refused("prompt_cache_options", "cache breakpoints and lifetimes are not supported", _null, {CHAT}),
    _refused("best_of", "only 1", lambda v: v in (None, 1), {COMPLETIONS}),
    _refused("echo", "only false (completions: the prompt; vLLM's chat: the last message)"),
    _refused("suffix", "insertion is not supported", endpoints={COMPLETIONS}),
    # vLLM's extensions
    _honoured("top_k", "vLLM: keep the k most likely tokens; 0 or -1 is off"),
    _honoured("min_p", "vLLM: drop tokens under min_p x the top token's probability"),
    _honoured("repetition_penalty", "vLLM: > 0, multiplicative over prompt and generated tokens; 1 is off"),
    _honoured("stop_token_ids", "vLLM: token ids that end the choice (their text is not shown)"),
    _honoured("ignore_eos", "vLLM: keep generating past EOS"),
    _honoured("min_tokens", "vLLM: EOS, stop token ids and stop strings do not count before this many tokens"),
    _honoured("skip_special_tokens", "vLLM: false shows special tokens in the text"),
    _honoured("chat_template_kwargs", "vLLM: variables for the chat template (e.g. `enable_thinking`); 400 for one "
              "the template never reads", {CHAT}),
    _honoured("add_generation_prompt", "vLLM: default true", {CHAT}),
    _honoured("continue_final_message", "vLLM: continue the last (assistant) message instead of starting one",
              {CHAT}),
    _honoured("add_special_tokens", "vLLM: tokenize the prompt with the tokenizer's special tokens (chat: default "
              "false, the template writes them; completions: default true)"),
    _honoured("request_id", "vLLM: becomes the response id (after `chatcmpl-`/`cmpl-`) and is logged"),
    _honoured("cache_salt", "vLLM: there is no prompt cache shared between requests to isolate"),
    _refused("include_stop_str_in_output", "only false", endpoints=BOTH),
    _refused("spaces_between_special_tokens", "only true", lambda v: v in (None, True)),
    _refused("chat_template", "per-request templates are not accepted", _null, {CHAT}),
    _refused("documents", "not supported", endpoints={CHAT}),
    _refused("use_beam_search", "beam search is not supported"),
    _refused("length_penalty", "beam search only", lambda v: v in (None, 1, 1.0)),
    _refused("prompt_logprobs", "not supported", _null),
    _refused("allowed_token_ids", "not supported"),
    _refused("bad_words", "not supported"),
    _refused("truncate_prompt_tokens", "not supported", _null),
    _refused("guided_json", "use `response_format` with `json_schema`", _null),
    _refused("guided_regex", "structured output is not supported yet", _null),
    _refused("guided_choice", "structured output is not supported yet", _null),
    _refused("guided_grammar", "structured output is not supported yet", _null),
    _refused("guided_decoding_backend", "structured output is not supported yet", _null),
    _refused("structured_outputs", "structured output is not supported yet", _null),
    _refused("priority", "only 0: requests run in arrival order"),
    _refused("return_tokens_as_token_ids", "not supported"),
    _refused("return_token_ids", "not supported"),
    _refused("prompt_embeds", "not supported", _null, {COMPLETIONS}),
    _refused("logits_processors", "not supported", _null),
    _refused("vllm_xargs", "not supported", _null),
    _refused("kv_transfer_params", "not supported", _null),
    _refused("mm_processor_kwargs", "not supported", _null),
)
BY_NAME = {f.name: f for f in FIELDS}
assert len(BY_NAME) == len(FIELDS), "a field is listed twice"


def fields_for(chat: bool) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if f.applies_to(chat)}


class UnknownFieldLog:
    """Logs each unknown field name once per process (a client sending it on every request must not
    flood the log); `seen` lists them for tests and /metrics-free inspection."""

    def __init__(self):
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, endpoint: str, names) -> None:
        with self._lock:
            new = sorted(set(names) - self.seen)
            self.seen.update(new)
        for name in new:
            log.warning("request field %r is not known to this server and was ignored (first seen on %s; "
                        "logged once)", name, endpoint)


def markdown_table() -> str:
    """The table docs/inference.md shows (a test keeps the two equal)."""
    rows = ["| field | chat | completions | what the server does |", "| --- | --- | --- | --- |"]
    for f in FIELDS:
        status = {HONOURED: "honoured", TAG: "tag", REFUSED: "refused"}[f.status]
        marks = [status if endpoint in f.endpoints else "" for endpoint in (CHAT, COMPLETIONS)]
        rows.append(f"| `{f.name}` | {marks[0]} | {marks[1]} | {f.note} |")
    return "\n".join(rows)
