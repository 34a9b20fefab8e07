"""The gRPC call metadata key naming a session on its Acquire stream: the server binds the stream
(and so the session's lifetime) when the call opens, before any request."""

SESSION_METADATA_KEY = "expertpack-session"
