"""storaged's gRPC daemon: start-up and shutdown (daemon), the servicer (protobuf edge), the
data path (engine), sessions, served models and the Stats/metrics glue.

Entry point: `storaged.server.daemon.run(config) -> exit status` (what `storaged` runs).
"""
