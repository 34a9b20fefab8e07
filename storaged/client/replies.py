"""Plain values for the Info and Stats replies, so callers never handle protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, fields

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_type: str  # Hugging Face model_type, e.g. "qwen3_moe"
    moe_layers: tuple[int, ...]  # model layer indices with routed experts
    expert_count: int  # routed experts per MoE layer
    max_object_bytes: int
    bundle_path: str  # on the daemon's host


@dataclass(frozen=True)
class ServerInfo:
    server_version: str
    api_version: int
    capabilities: frozenset[str]  # e.g. {"MEMFD_ARENA", "PREFETCH", "CHECKSUM_VERIFY", "DIRECT_IO"}
    models: dict[str, ModelInfo]
    device: str  # "cpu" or "cuda:N"
    slot_bytes: int
    slot_count: int
    host_cache_bytes: int  # 0: host tier off
    max_ids_per_acquire: int


@dataclass(frozen=True)
class TierStats:
    hits: int
    misses: int  # includes misses that joined a load in flight (`coalesced`)
    evictions: int
    resident_experts: int
    resident_bytes: int
    capacity_slots: int
    coalesced: int


@dataclass(frozen=True)
class Stats:
    tiers: dict[str, TierStats]  # "vram", and "host" when that tier is on
    bytes_read: int
    h2d_bytes: int
    io_errors: int
    checksum_failures: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    sessions: int
    pins: int  # VRAM pins held by all sessions now
    acquires: int
    capacity_exhausted: int
    acquire_latency_mean_us: float
    read_latency_mean_us: float
    loads_in_flight: int
    reads: int
    demotions: int  # VRAM victims copied down to the host tier
    d2h_bytes: int
    fence_waits: int  # slot reuses that waited for a session's device step
    fence_revocations: int
    hits_verified: int  # hits re-checked against their checksum (verify_hits)
    hit_mismatches: int  # verified hits that failed and were reloaded from the pack


def server_info(reply: pb.InfoResponse) -> ServerInfo:
    models = {m.name: ModelInfo(m.name, m.model_type, tuple(m.moe_layers), m.expert_count,
                                m.max_object_bytes, m.bundle_path) for m in reply.models}
    capabilities = frozenset(pb.Capability.Name(c).removeprefix("CAPABILITY_") for c in reply.capabilities)
    return ServerInfo(reply.server_version, reply.api_version, capabilities, models, reply.device,
                      reply.slot_bytes, reply.slot_count, reply.host_cache_bytes, reply.max_ids_per_acquire)


def stats(reply: pb.StatsResponse) -> Stats:
    """Every field of Stats from the reply field of the same name (one list: the dataclass)."""
    tiers = {t.tier: TierStats(t.hits, t.misses, t.evictions, t.resident_experts, t.resident_bytes,
                               t.capacity_slots, t.coalesced) for t in reply.tiers}
    return Stats(tiers=tiers, **{f.name: getattr(reply, f.name) for f in fields(Stats) if f.name != "tiers"})
