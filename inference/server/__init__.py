"""The OpenAI-compatible HTTP server of `inference serve`."""

from inference.server.app import create_app
from inference.server.protocol import ParsedRequest, parse_request
from inference.server.state import ServerState

__all__ = ["ServerState", "create_app", "ParsedRequest", "parse_request"]
