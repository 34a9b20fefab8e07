"""storaged: the per-host daemon serving routed-expert slots from a VRAM/host cache over gRPC.

Subpackages: `policy` (cache decisions, pure Python), `device` (the slot arena), `io` (pack
reads), `server` (the gRPC daemon), `client` (what inference links against; no server imports).
"""

__version__ = "0.1.0"
