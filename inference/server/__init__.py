"""The OpenAI-compatible HTTP server of `inference serve`."""

from inference.server.app import ServerState, create_app
from inference.server.protocol import ParsedRequest, parse_request

__all__ = ["ServerState", "create_app", "ParsedRequest", "parse_request"]
