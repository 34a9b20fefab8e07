"""Protobuf ↔ internal values, at the servicer's edge only: nothing past it sees protobuf."""

from __future__ import annotations

from dataclasses import dataclass

from packformat.index import ObjectEntry
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.device.descriptor import KIND_CUDA_IPC, KIND_MEMFD, ArenaDescriptor
from storaged.policy import SlotMapLayout
from storaged.server.models import LayerObjects, ServedModel

API_VERSION = 1


@dataclass(frozen=True, slots=True)
class AcquireCommand:
    session_id: str
    layer: int
    experts: tuple[int, ...]
    request_id: int
    release_other_layers: bool = False  # drop the session's pins on the model's other layers


@dataclass(frozen=True, slots=True)
class AcquireResult:
    request_id: int
    slots: tuple[int, ...]  # in request order
    ready_events: tuple[int, ...]  # per slot: event index to wait on, or -1 when complete


@dataclass(frozen=True, slots=True)
class PrefetchCommand:
    session_id: str
    layer: int
    experts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReleaseCommand:
    session_id: str
    layer: int | None  # None: every layer


def acquire_command(request: pb.AcquireRequest) -> AcquireCommand:
    return AcquireCommand(request.session_id, request.layer, tuple(request.experts), request.request_id,
                          request.release_other_layers)


def acquire_response(result: AcquireResult) -> pb.AcquireResponse:
    return pb.AcquireResponse(request_id=result.request_id, slots=result.slots,
                              ready_events=result.ready_events)


def prefetch_command(request: pb.PrefetchRequest) -> PrefetchCommand:
    return PrefetchCommand(request.session_id, request.layer, tuple(request.experts))


def release_command(request: pb.ReleaseRequest) -> ReleaseCommand:
    return ReleaseCommand(request.session_id, request.layer if request.HasField("layer") else None)


def model_info(model: ServedModel) -> pb.ModelInfo:
    return pb.ModelInfo(name=model.name, model_type=model.model_type, moe_layers=model.moe_layers,
                        expert_count=model.expert_count, max_object_bytes=model.max_object_bytes,
                        bundle_path=str(model.bundle.path))


def _roles(entry: ObjectEntry) -> list[pb.RoleLayout]:
    return [pb.RoleLayout(role=r.role, element_type=r.element_type, shape=r.shape, offset=r.offset,
                          nbytes=r.nbytes) for r in entry.roles]


def _layer_layout(layer: LayerObjects, expert_count: int) -> pb.LayerLayout:
    return pb.LayerLayout(
        layer=layer.layer, expert_count=expert_count, object_bytes=layer.common.size,
        roles=_roles(layer.common),
        expert_overrides=[pb.ExpertLayout(expert=e.expert, object_bytes=e.size, roles=_roles(e))
                          for e in layer.overrides],
    )


def model_layout(model: ServedModel) -> pb.ModelLayout:
    return pb.ModelLayout(model=model.name,
                          layers=[_layer_layout(layer, model.expert_count) for layer in model.layers])


def slot_map(layout: SlotMapLayout, model: ServedModel) -> pb.SlotMap:
    return pb.SlotMap(offset_bytes=4 * layout.model_base(model.model_id), experts_per_row=model.expert_count,
                      layers=layout.layers(model.model_id))


def arena_descriptor(descriptor: ArenaDescriptor) -> pb.ArenaDescriptor:
    if descriptor.kind == KIND_MEMFD:
        return pb.ArenaDescriptor(memfd=pb.MemfdArena(), size_bytes=descriptor.arena_bytes,
                                  slot_map_entries=descriptor.map_entries, host_slots=descriptor.host_slots)
    assert descriptor.kind == KIND_CUDA_IPC, descriptor.kind
    d = descriptor
    return pb.ArenaDescriptor(
        cuda_ipc=pb.CudaIpcArena(
            ipc_handle=d.ipc_handle, device=d.device_index, storage_size_bytes=d.storage_size_bytes,
            storage_offset_bytes=d.storage_offset_bytes, ref_counter_handle=d.ref_counter_handle,
            ref_counter_offset=d.ref_counter_offset, event_handle=d.export_event_handle,
            event_sync_required=d.export_event_sync_required),
        size_bytes=d.arena_bytes, event_handles=d.event_handles, slot_map_entries=d.map_entries,
        host_slots=d.host_slots)
