"""Client-side view of what Attach returns: the arena descriptor and where each role of an
expert object lies in a slot.

Plain dataclasses built from the protobuf once per session, so inference never touches
generated code on its hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.device.descriptor import KIND_CUDA_IPC, KIND_MEMFD, ArenaDescriptor
from storaged.device.errors import ArenaDescriptorError


@dataclass(frozen=True)
class RoleLayout:
    role: int  # packformat Role id (1 gate, 2 up, 3 down, 4 gate_up, 5..8 biases, 9..12 block scales)
    element_type: int  # packformat.constants.ElementType id: GGML's (< 256) or the pack's own
    shape: tuple[int, ...]  # logical elements, last dim contiguous and blocked
    offset: int  # bytes from the start of the slot
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ObjectLayout:
    object_bytes: int  # payload bytes of the object (<= slot_bytes)
    roles: tuple[RoleLayout, ...]

    def role(self, role: int) -> RoleLayout:
        for entry in self.roles:
            if entry.role == role:
                return entry
        raise KeyError(f"object has no role {role} (has {[r.role for r in self.roles]})")


@dataclass(frozen=True)
class LayerLayout:
    layer: int  # model layer index
    expert_count: int
    common: ObjectLayout  # layout of every expert not in `overrides`
    overrides: dict[int, ObjectLayout]  # expert id → its own layout (normally empty)

    def object(self, expert: int) -> ObjectLayout:
        if not 0 <= expert < self.expert_count:
            raise KeyError(f"layer {self.layer}: expert {expert} out of range [0, {self.expert_count})")
        return self.overrides.get(expert, self.common)


def _roles_from_proto(roles) -> tuple[RoleLayout, ...]:
    return tuple(RoleLayout(int(r.role), r.element_type, tuple(r.shape), r.offset, r.nbytes) for r in roles)


def layers_from_proto(layout: pb.ModelLayout) -> dict[int, LayerLayout]:
    """Model layer index → LayerLayout."""
    layers = {}
    for layer in layout.layers:
        overrides = {o.expert: ObjectLayout(o.object_bytes, _roles_from_proto(o.roles))
                     for o in layer.expert_overrides}
        common = ObjectLayout(layer.object_bytes, _roles_from_proto(layer.roles))
        layers[layer.layer] = LayerLayout(layer.layer, layer.expert_count, common, overrides)
    return layers


@dataclass(frozen=True)
class SlotMapView:
    """Where a model's rows of the arena's slot map are (AttachResponse.slot_map)."""

    offset_bytes: int  # of the model's first entry, from the start of the arena allocation
    experts_per_row: int
    layers: tuple[int, ...]  # model layer index of each row

    def row(self, layer: int) -> int:
        """The row of a MoE layer; KeyError naming the layers when it has none."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer} has no row in the slot map (rows: {list(self.layers)})") from None


def slot_map_from_proto(reply: pb.AttachResponse) -> SlotMapView | None:
    if not reply.HasField("slot_map"):
        return None
    m = reply.slot_map
    return SlotMapView(m.offset_bytes, m.experts_per_row, tuple(m.layers))


def arena_from_proto(arena: pb.ArenaDescriptor, slot_bytes: int, slot_count: int) -> ArenaDescriptor:
    """The device module's descriptor, ready for map_arena (a memfd arena also needs its fd)."""
    which = arena.WhichOneof("memory")
    if which == "memfd":
        return ArenaDescriptor(kind=KIND_MEMFD, slot_bytes=slot_bytes, slot_count=slot_count,
                               map_entries=arena.slot_map_entries, host_slots=arena.host_slots)
    if which == "shm":
        raise ArenaDescriptorError(f"the daemon offers a path-named shared-memory arena ({arena.shm.path}), which "
                                   "any process its file mode lets in could write; this client maps sealed memfd "
                                   "and CUDA IPC arenas only (upgrade storaged)")
    if which == "cuda_ipc":
        c = arena.cuda_ipc
        return ArenaDescriptor(
            kind=KIND_CUDA_IPC, slot_bytes=slot_bytes, slot_count=slot_count, device_index=c.device,
            ipc_handle=c.ipc_handle, storage_size_bytes=c.storage_size_bytes,
            storage_offset_bytes=c.storage_offset_bytes, ref_counter_handle=c.ref_counter_handle,
            ref_counter_offset=c.ref_counter_offset, export_event_handle=c.event_handle,
            export_event_sync_required=c.event_sync_required, event_handles=tuple(arena.event_handles),
            map_entries=arena.slot_map_entries, host_slots=arena.host_slots)
    raise ArenaDescriptorError(f"Attach reply has no arena memory (oneof 'memory' is {which!r})")
