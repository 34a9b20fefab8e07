"""The data plane: storaged's hot-path protocol on a Unix socket beside the gRPC one (version 3).

gRPC stays the control plane (Info, Attach, Stats, health); a Python gRPC round trip costs
hundreds of microseconds, so the per-layer requests of a decode step travel here instead:
fixed little-endian frames, one connection per session, requests answered in order.

Every frame is a 16-byte header `<IHHQ`: body length, kind, flags (0), request id; then the body.

    client                                      server
    HELLO      u32 version, utf-8 session id ->
                                             <- HELLO_OK u32 version   (+ the session's fence
                                                page as an SCM_RIGHTS file descriptor)
    ACQUIRE    u32 layer, u32 flags (bit 0: release other layers), u32 n, n x u32 expert ->
                                             <- ACQUIRE_OK n x (u32 slot, i32 ready event)
    PREFETCH   u32 layer, u32 n, n x u32 expert ->
                                             <- PREFETCH_OK u32 loads started
    RELEASE    u32 has_layer, u32 layer      -> <- RELEASE_OK (empty)
                                             <- ERROR u32 status code, utf-8 message

A connection whose first frame is ARENA instead of HELLO only fetches the arena's file
descriptor (a memfd arena, AttachResponse.arena.memfd) and is then closed by the daemon; it binds
nothing, so a session on a gRPC Acquire stream maps its arena this way too:

    ARENA      u32 version, utf-8 session id ->
                                             <- ARENA_OK (empty) + the arena's memfd (SCM_RIGHTS)

The file is sealed against writes: a client can map it read-only only (docs/storaged.md). Like
every request, ARENA is answered only to a peer the allow-list admits: a refused one gets
PERMISSION_DENIED and no descriptor. HOST_TIER is the same exchange for the host tier's memory
file, which a client maps to read host-tier objects in place (ArenaDescriptor.host_slots > 0;
FAILED_PRECONDITION where the daemon shares no host tier):

    HOST_TIER  u32 version, utf-8 session id ->
                                             <- HOST_TIER_OK (empty) + the host tier's memfd

The ERROR status codes are gRPC's canonical codes (storaged.wire.status.StatusCode) with the
meanings the proto lists for Acquire, Prefetch and Release; a request that fails is answered with
ERROR and the connection stays usable, except after a malformed frame (INVALID_ARGUMENT, then
closed) or a refused HELLO. The connection binds the session like an Acquire stream: while it is open the
session's pins live, and when it closes they are released and the session ends.

The fence page (FENCE_BYTES, little-endian u64 words) is how a client that reads the slot map on
the device tells the daemon which slots it may still be reading: it writes STARTED = n before
launching step n and FINISHED = n once step n's work has completed; the daemon reuses a slot
whose map entry it cleared only after every session that was mid-step at that moment finished
that step. A client may launch step n + 1 before step n completed (STARTED = n + 1 with
FINISHED = n - 1); its steps finish in order, so FINISHED = n says every step up to n completed,
and a daemon that waits for the STARTED it saw waits for all of them. REVOKED (written by the daemon) is non-zero once the daemon stopped honouring the
page (the session ended, or it stayed mid-step longer than the daemon's fence timeout): a step
that finished after that may have read overwritten slots and must not be trusted.
"""

from __future__ import annotations

import struct

VERSION = 3  # 3: HOST_TIER and the host map; 2: the ARENA exchange; 1 had path-named shared-memory arenas

HEADER = struct.Struct("<IHHQ")  # body bytes, kind, flags, request id
assert HEADER.size == 16
MAX_BODY = 1 << 20  # bytes; far above the largest legal request (max ids * 4 + 12)


class Kind:
    HELLO = 1
    HELLO_OK = 2
    ACQUIRE = 3
    ACQUIRE_OK = 4
    PREFETCH = 5
    PREFETCH_OK = 6
    RELEASE = 7
    RELEASE_OK = 8
    ARENA = 9
    ARENA_OK = 10
    HOST_TIER = 11
    HOST_TIER_OK = 12
    ERROR = 15


ACQUIRE_RELEASE_OTHER_LAYERS = 1  # ACQUIRE flags bit 0

U32 = struct.Struct("<I")
U32_MAX = 2**32 - 1  # layer and expert ids above it cannot be framed (gRPC refuses them too)
ACQUIRE_HEAD = struct.Struct("<III")  # layer, flags, count
PREFETCH_HEAD = struct.Struct("<II")  # layer, count
RELEASE_BODY = struct.Struct("<II")  # has_layer, layer
ERROR_HEAD = struct.Struct("<I")  # status code
SLOT_EVENT = struct.Struct("<Ii")  # slot, ready event (-1: complete)

# fence page: u64 words at these byte offsets
FENCE_BYTES = 4096
FENCE_STARTED = 0
FENCE_FINISHED = 8
FENCE_REVOKED = 16


def frame(kind: int, request_id: int, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body), kind, 0, request_id) + body


def u32_array(values) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def socket_path_for(grpc_socket: str) -> str:
    """The data plane's socket beside the gRPC one: `<socket>.data`."""
    return f"{grpc_socket}.data"
