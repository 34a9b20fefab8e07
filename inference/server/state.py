"""What the handlers share: the served model's name, its engine once loaded, and the server's options."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from aiohttp import web

from inference.engine import Engine, EngineMetrics
from inference.server.fields import UnknownFieldLog
from inference.server.token_text import TokenTexts


@dataclasses.dataclass
class ServerState:
    """`engine` is None until the model has loaded (or when it failed: `load_error`)."""

    model_name: str
    metrics: EngineMetrics
    engine: Engine | None = None
    load_error: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    max_tokens: int | None = None  # the server's cap on a request's max_tokens (and its default)
    generation_defaults: Mapping[str, object] = dataclasses.field(default_factory=dict)
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    allowed_origins: tuple[str, ...] = ()
    access_log: bool = True
    unknown_fields: UnknownFieldLog = dataclasses.field(default_factory=UnknownFieldLog)
    _token_texts: TokenTexts | None = None

    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer)
        return self._token_texts


STATE = web.AppKey("state", ServerState)
