"""Plain values for the Info and Stats replies, so callers never handle protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.stats_snapshot import StatsSnapshot as Stats
from storaged.stats_snapshot import TierStats

__all__ = ["ModelInfo", "ServerInfo", "Stats", "TierStats", "server_info", "stats"]


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


def server_info(reply: pb.InfoResponse) -> ServerInfo:
    models = {m.name: ModelInfo(m.name, m.model_type, tuple(m.moe_layers), m.expert_count,
                                m.max_object_bytes, m.bundle_path) for m in reply.models}
    capabilities = frozenset(pb.Capability.Name(c).removeprefix("CAPABILITY_") for c in reply.capabilities)
    return ServerInfo(reply.server_version, reply.api_version, capabilities, models, reply.device,
                      reply.slot_bytes, reply.slot_count, reply.host_cache_bytes, reply.max_ids_per_acquire)


def stats(reply: pb.StatsResponse) -> Stats:
    """The snapshot the daemon rendered, rebuilt from the reply's `figures` map (so a figure the
    field table gains needs nothing here); the tier list from `tiers`."""
    return Stats.from_series(dict(reply.figures), tuple(t.tier for t in reply.tiers))
