"""Everything the daemon allocates at start-up, built from the config in a fixed order and
closed in the reverse order."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from packformat.constants import ALIGNMENT, align_up
from storaged.config import StoragedConfig
from storaged.device import Arena, ArenaError, HostTier, create_arena
from storaged.io import (DirectIOUnsupported, DirectPackFile, HostPinError, ReadExecutor, StagingPool,
                         StorageIOError)
from storaged.metrics import MetricsServer, StoragedMetrics
from storaged.policy import AcquirePlanner, SlotCache, SlotMapLayout
from storaged.server.engine import StorageEngine
from storaged.server.fences import FenceTable
from storaged.server.hit_verify import HitVerifier
from storaged.server.models import ServedModel

CUDA_COPY_EVENTS = 256  # interprocess events cycled over copies into the arena


class StartupError(Exception):
    """The daemon cannot start with this configuration; the message says why and what to change."""


@dataclass(frozen=True)
class SlotGeometry:
    slot_bytes: int  # the largest padded object of any served model
    slot_count: int  # arena slots within vram_cache_bytes
    host_slots: int  # host-tier slots within host_cache_bytes (0: tier off)


def slot_geometry(config: StoragedConfig, models: Mapping[str, ServedModel]) -> SlotGeometry:
    slot_bytes = align_up(max(m.max_object_bytes for m in models.values()), ALIGNMENT)
    slot_count = config.vram_cache_bytes // slot_bytes
    if slot_count == 0:
        largest = max(models.values(), key=lambda m: m.max_object_bytes)
        raise StartupError(f"vram_cache_bytes = {config.vram_cache_bytes} holds no slot: model "
                           f"{largest.name!r} has objects of up to {largest.max_object_bytes} bytes "
                           f"(slots of {slot_bytes} bytes); raise vram_cache_bytes")
    for model in models.values():
        # a token's top-k experts of one layer must be resident at once: fewer slots can never serve
        # a decode step, so refuse now rather than fail every request later
        top_k = model.bundle.experts.get("top_k")
        if isinstance(top_k, int) and slot_count < top_k:
            raise StartupError(f"vram_cache_bytes = {config.vram_cache_bytes} holds {slot_count} slot(s) of "
                               f"{slot_bytes} bytes; model {model.name!r} routes each token to {top_k} experts a "
                               f"layer, so at least {top_k} slots ({top_k * slot_bytes} bytes) are needed; raise "
                               "vram_cache_bytes (a prefill needs up to one layer's experts)")
    return SlotGeometry(slot_bytes, slot_count, config.host_cache_bytes // slot_bytes)


@dataclass
class Runtime:
    geometry: SlotGeometry
    arena: Arena
    staging: StagingPool
    host_tier: HostTier | None
    executor: ReadExecutor
    metrics: StoragedMetrics
    planner: AcquirePlanner
    engine: StorageEngine
    slot_map: SlotMapLayout
    fences: FenceTable
    metrics_server: MetricsServer | None = None
    verifier: HitVerifier | None = None

    def close(self) -> None:
        """Stop reads, then free memory; call after the engine drained its loads."""
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.executor.close()
        if self.verifier is not None:
            self.verifier.close()
        self.fences.close()
        self.arena.synchronize()
        self.staging.close()
        if self.host_tier is not None:
            self.host_tier.close()
        self.arena.close()


def _start_metrics(metrics: StoragedMetrics, address: str) -> MetricsServer:
    host, _, port = address.rpartition(":")
    try:
        return metrics.start_http_server(int(port), addr=host.strip("[]"))
    except OSError as exc:
        raise StartupError(f"metrics_address {address!r}: cannot listen: {exc.strerror or exc}; "
                           "choose another address or set metrics_address = \"off\"") from None


def build_runtime(config: StoragedConfig, models: Mapping[str, ServedModel]) -> Runtime:
    """Allocate arena, staging, host tier and reader; raise StartupError on any failure."""
    geometry = slot_geometry(config, models)
    cuda = config.cuda_device_index is not None
    layouts = {m.model_id: m.policy_layout(config.max_ids_per_acquire) for m in models.values()}
    slot_map = SlotMapLayout(layouts)
    with contextlib.ExitStack() as undo:
        metrics = StoragedMetrics()
        try:
            executor = ReadExecutor(workers=config.io_parallelism, metrics=metrics)
            undo.callback(executor.close)
            for model in models.values():
                executor.add_pack(model.name, DirectPackFile(
                    model.pack.path, direct_io=config.direct_io, verify=config.verify_checksums))
            arena = create_arena("cuda" if cuda else "cpu", geometry.slot_count, geometry.slot_bytes,
                                 map_entries=slot_map.entries, host_slots=geometry.host_slots,
                                 device=config.cuda_device_index or 0,
                                 event_count=CUDA_COPY_EVENTS)
            undo.callback(arena.close)
            staging = StagingPool(config.staging_buffers, geometry.slot_bytes, pin=cuda)
            undo.callback(staging.close)
            host_tier = None
            if geometry.host_slots:
                # shared: clients read host-tier objects in place, found through the arena's host map
                host_tier = HostTier(geometry.host_slots, geometry.slot_bytes, pin=cuda, shared=True)
                undo.callback(host_tier.close)
        except DirectIOUnsupported as exc:
            raise StartupError(str(exc)) from None
        except (ArenaError, HostPinError, StorageIOError, OSError) as exc:
            raise StartupError(f"cannot allocate the cache on {config.device}: {exc}") from None
        planner = AcquirePlanner(
            SlotCache(geometry.slot_count, slot_bytes=geometry.slot_bytes, tier="vram"),
            SlotCache(geometry.host_slots, slot_bytes=geometry.slot_bytes, tier="host")
            if geometry.host_slots else None, layouts)
        fences = FenceTable(timeout=config.fence_timeout_seconds)
        verifier = HitVerifier(config.verify_hits, arena, staging, metrics) if config.verify_hits else None
        engine = StorageEngine(planner, arena, staging, executor, metrics, host_tier=host_tier,
                               max_ids=config.max_ids_per_acquire, slot_map=slot_map, fences=fences,
                               sizes={m.model_id: m for m in models.values()}, verifier=verifier)
        metrics_server = _start_metrics(metrics, config.metrics_address) if config.metrics_enabled else None
        undo.pop_all()
    return Runtime(geometry, arena, staging, host_tier, executor, metrics, planner, engine, slot_map, fences,
                   metrics_server, verifier)
