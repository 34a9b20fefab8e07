"""ArenaDescriptor: everything a client needs to map a storaged arena, as plain values.

The server builds one per session (Arena.descriptor()) and sends it in the Attach reply; the
client passes it to storaged.device.client_arena.map_arena. Fields hold only ints, strings and
bytes, so the gRPC layer can copy them to and from protobuf without knowing what they mean.
A memfd arena's descriptor carries no handle at all: the memory is reachable only through the
file descriptor the daemon hands an admitted client over the data plane.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packformat.constants import ALIGNMENT, align_up
from storaged.device.errors import ArenaDescriptorError

KIND_MEMFD = "memfd"  # a sealed memory file, passed as a descriptor over the data plane (no CUDA)
KIND_CUDA_IPC = "cuda_ipc"  # one device allocation exported with cudaIpcGetMemHandle
KINDS = (KIND_MEMFD, KIND_CUDA_IPC)


@dataclass(frozen=True)
class ArenaDescriptor:
    kind: str  # KIND_MEMFD or KIND_CUDA_IPC
    slot_bytes: int  # bytes per slot, a multiple of 4096
    slot_count: int
    # KIND_CUDA_IPC: the fields of torch's UntypedStorage._share_cuda_() for the arena storage.
    device_index: int = -1
    ipc_handle: bytes = b""  # cudaIpcMemHandle of the allocation holding the arena
    storage_size_bytes: int = 0  # bytes of the arena storage (slot_bytes * slot_count)
    storage_offset_bytes: int = 0  # where the arena starts inside that allocation
    ref_counter_handle: bytes = b""  # torch's cross-process refcount file for this export
    ref_counter_offset: int = 0
    export_event_handle: bytes = b""  # event the client waits on once, before first use
    export_event_sync_required: bool = False
    # KIND_CUDA_IPC: interprocess copy events; a CopyHandle's event_index indexes this list.
    event_handles: tuple[bytes, ...] = field(default_factory=tuple)
    # int32 entries of the slot map that follows the slots (at byte arena_bytes); 0: no map
    map_entries: int = 0
    # slots of the daemon's host tier that clients may read in place; when > 0 a second map of
    # map_entries entries (object -> host slot, -1: not there) follows the first
    host_slots: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "event_handles", tuple(self.event_handles))
        if self.kind not in KINDS:
            raise ArenaDescriptorError(f"arena kind {self.kind!r} is not one of {KINDS}")
        if self.slot_bytes <= 0 or self.slot_bytes % ALIGNMENT:
            raise ArenaDescriptorError(f"slot_bytes {self.slot_bytes} is not a positive multiple of {ALIGNMENT}")
        if self.slot_count <= 0:
            raise ArenaDescriptorError(f"slot_count {self.slot_count} must be > 0")
        if self.kind == KIND_CUDA_IPC:
            if self.device_index < 0 or not self.ipc_handle or not self.ref_counter_handle:
                raise ArenaDescriptorError(f"cuda_ipc arena descriptor lacks device {self.device_index}, "
                                           "IPC handle or ref counter handle")
            if self.storage_size_bytes < self.mapped_bytes:
                raise ArenaDescriptorError(f"storage of {self.storage_size_bytes} bytes cannot hold "
                                           f"{self.slot_count} slots of {self.slot_bytes} bytes and a slot map "
                                           f"of {self.map_entries} entries")
        if self.map_entries < 0:
            raise ArenaDescriptorError(f"map_entries {self.map_entries} must be >= 0")
        if self.host_slots < 0 or (self.host_slots and not self.map_entries):
            raise ArenaDescriptorError(f"host_slots {self.host_slots} must be >= 0, and 0 without a slot map")

    @property
    def arena_bytes(self) -> int:
        """Bytes of the slots (slot s at byte s * slot_bytes)."""
        return self.slot_bytes * self.slot_count

    @property
    def map_offset(self) -> int:
        """Byte offset of the slot map: right after the slots (a multiple of 4096)."""
        return self.arena_bytes

    @property
    def host_map_offset(self) -> int:
        """Byte offset of the host map (meaningful when host_slots > 0): right after the slot map."""
        return self.arena_bytes + 4 * self.map_entries

    @property
    def mapped_bytes(self) -> int:
        """Bytes a client maps: the slots, the slot map and the host map."""
        return self.arena_bytes + map_region_bytes(map_region_entries(self.map_entries, self.host_slots))


def map_region_entries(map_entries: int, host_slots: int) -> int:
    """int32 entries of the map region: the slot map, and the host map when there are host slots."""
    return map_entries * (2 if host_slots else 1)


def map_region_bytes(entries: int) -> int:
    """Bytes the slot map of `entries` int32 entries takes, padded to whole pages."""
    return align_up(4 * entries, ALIGNMENT)
