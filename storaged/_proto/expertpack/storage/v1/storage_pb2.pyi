from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Capability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPABILITY_UNSPECIFIED: _ClassVar[Capability]
    CAPABILITY_SHM_ARENA: _ClassVar[Capability]
    CAPABILITY_CUDA_IPC_ARENA: _ClassVar[Capability]
    CAPABILITY_HOST_CACHE: _ClassVar[Capability]
    CAPABILITY_PREFETCH: _ClassVar[Capability]
    CAPABILITY_CHECKSUM_VERIFY: _ClassVar[Capability]
    CAPABILITY_DIRECT_IO: _ClassVar[Capability]
    CAPABILITY_DATA_PLANE: _ClassVar[Capability]
    CAPABILITY_SLOT_MAP: _ClassVar[Capability]
    CAPABILITY_TIERED_DEMOTION: _ClassVar[Capability]
    CAPABILITY_MEMFD_ARENA: _ClassVar[Capability]
    CAPABILITY_HIT_VERIFY: _ClassVar[Capability]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_GATE: _ClassVar[Role]
    ROLE_UP: _ClassVar[Role]
    ROLE_DOWN: _ClassVar[Role]
    ROLE_GATE_UP: _ClassVar[Role]
    ROLE_GATE_BIAS: _ClassVar[Role]
    ROLE_UP_BIAS: _ClassVar[Role]
    ROLE_DOWN_BIAS: _ClassVar[Role]
    ROLE_GATE_UP_BIAS: _ClassVar[Role]
    ROLE_GATE_SCALE: _ClassVar[Role]
    ROLE_UP_SCALE: _ClassVar[Role]
    ROLE_DOWN_SCALE: _ClassVar[Role]
    ROLE_GATE_UP_SCALE: _ClassVar[Role]
CAPABILITY_UNSPECIFIED: Capability
CAPABILITY_SHM_ARENA: Capability
CAPABILITY_CUDA_IPC_ARENA: Capability
CAPABILITY_HOST_CACHE: Capability
CAPABILITY_PREFETCH: Capability
CAPABILITY_CHECKSUM_VERIFY: Capability
CAPABILITY_DIRECT_IO: Capability
CAPABILITY_DATA_PLANE: Capability
CAPABILITY_SLOT_MAP: Capability
CAPABILITY_TIERED_DEMOTION: Capability
CAPABILITY_MEMFD_ARENA: Capability
CAPABILITY_HIT_VERIFY: Capability
ROLE_UNSPECIFIED: Role
ROLE_GATE: Role
ROLE_UP: Role
ROLE_DOWN: Role
ROLE_GATE_UP: Role
ROLE_GATE_BIAS: Role
ROLE_UP_BIAS: Role
ROLE_DOWN_BIAS: Role
ROLE_GATE_UP_BIAS: Role
ROLE_GATE_SCALE: Role
ROLE_UP_SCALE: Role
ROLE_DOWN_SCALE: Role
ROLE_GATE_UP_SCALE: Role

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("server_version", "api_version", "capabilities", "models", "device", "slot_bytes", "slot_count", "host_cache_bytes", "max_ids_per_acquire")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_PER_ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    api_version: int
    capabilities: _containers.RepeatedScalarFieldContainer[Capability]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    device: str
    slot_bytes: int
    slot_count: int
    host_cache_bytes: int
    max_ids_per_acquire: int
    def __init__(self, server_version: _Optional[str] = ..., api_version: _Optional[int] = ..., capabilities: _Optional[_Iterable[_Union[Capability, str]]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., device: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ..., host_cache_bytes: _Optional[int] = ..., max_ids_per_acquire: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_type", "moe_layers", "expert_count", "max_object_bytes", "bundle_path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_type: str
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    expert_count: int
    max_object_bytes: int
    bundle_path: str
    def __init__(self, name: _Optional[str] = ..., model_type: _Optional[str] = ..., moe_layers: _Optional[_Iterable[int]] = ..., expert_count: _Optional[int] = ..., max_object_bytes: _Optional[int] = ..., bundle_path: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session_id", "arena", "slot_bytes", "slot_count", "layout", "slot_map", "data_plane")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAP_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    arena: ArenaDescriptor
    slot_bytes: int
    slot_count: int
    layout: ModelLayout
    slot_map: SlotMap
    data_plane: DataPlane
    def __init__(self, session_id: _Optional[str] = ..., arena: _Optional[_Union[ArenaDescriptor, _Mapping]] = ..., slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ..., layout: _Optional[_Union[ModelLayout, _Mapping]] = ..., slot_map: _Optional[_Union[SlotMap, _Mapping]] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ...) -> None: ...

class SlotMap(_message.Message):
    __slots__ = ("offset_bytes", "experts_per_row", "layers")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    experts_per_row: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset_bytes: _Optional[int] = ..., experts_per_row: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class DataPlane(_message.Message):
    __slots__ = ("socket_path", "version")
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    socket_path: str
    version: int
    def __init__(self, socket_path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ArenaDescriptor(_message.Message):
    __slots__ = ("shm", "cuda_ipc", "memfd", "size_bytes", "event_handles", "slot_map_entries", "host_slots")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    MEMFD_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAP_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    shm: SharedMemoryArena
    cuda_ipc: CudaIpcArena
    memfd: MemfdArena
    size_bytes: int
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    slot_map_entries: int
    host_slots: int
    def __init__(self, shm: _Optional[_Union[SharedMemoryArena, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcArena, _Mapping]] = ..., memfd: _Optional[_Union[MemfdArena, _Mapping]] = ..., size_bytes: _Optional[int] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., slot_map_entries: _Optional[int] = ..., host_slots: _Optional[int] = ...) -> None: ...

class SharedMemoryArena(_message.Message):
    __slots__ = ("path", "offset")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class MemfdArena(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CudaIpcArena(_message.Message):
    __slots__ = ("ipc_handle", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    device: int
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, ipc_handle: _Optional[bytes] = ..., device: _Optional[int] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class ModelLayout(_message.Message):
    __slots__ = ("model", "layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerLayout]
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerLayout, _Mapping]]] = ...) -> None: ...

class LayerLayout(_message.Message):
    __slots__ = ("layer", "expert_count", "object_bytes", "roles", "expert_overrides")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_COUNT_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_count: int
    object_bytes: int
    roles: _containers.RepeatedCompositeFieldContainer[RoleLayout]
    expert_overrides: _containers.RepeatedCompositeFieldContainer[ExpertLayout]
    def __init__(self, layer: _Optional[int] = ..., expert_count: _Optional[int] = ..., object_bytes: _Optional[int] = ..., roles: _Optional[_Iterable[_Union[RoleLayout, _Mapping]]] = ..., expert_overrides: _Optional[_Iterable[_Union[ExpertLayout, _Mapping]]] = ...) -> None: ...

class ExpertLayout(_message.Message):
    __slots__ = ("expert", "object_bytes", "roles")
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    expert: int
    object_bytes: int
    roles: _containers.RepeatedCompositeFieldContainer[RoleLayout]
    def __init__(self, expert: _Optional[int] = ..., object_bytes: _Optional[int] = ..., roles: _Optional[_Iterable[_Union[RoleLayout, _Mapping]]] = ...) -> None: ...

class RoleLayout(_message.Message):
    __slots__ = ("role", "element_type", "shape", "offset", "nbytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    role: Role
    element_type: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., element_type: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "layer", "experts", "request_id", "release_other_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_OTHER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    release_other_layers: bool
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ..., release_other_layers: _Optional[bool] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("request_id", "slots", "ready_events")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    ready_events: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., ready_events: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "layer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer: int
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "layer", "experts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "bytes_read", "h2d_bytes", "io_errors", "checksum_failures", "prefetch_issued", "prefetch_used", "prefetch_wasted", "sessions", "pins", "acquires", "capacity_exhausted", "acquire_latency_mean_us", "read_latency_mean_us", "loads_in_flight", "reads", "demotions", "d2h_bytes", "fence_waits", "fence_revocations", "hits_verified", "hit_mismatches", "figures")
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    H2D_BYTES_FIELD_NUMBER: _ClassVar[int]
    IO_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ISSUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WASTED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_LATENCY_MEAN_US_FIELD_NUMBER: _ClassVar[int]
    READ_LATENCY_MEAN_US_FIELD_NUMBER: _ClassVar[int]
    LOADS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    D2H_BYTES_FIELD_NUMBER: _ClassVar[int]
    FENCE_WAITS_FIELD_NUMBER: _ClassVar[int]
    FENCE_REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    HIT_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    bytes_read: int
    h2d_bytes: int
    io_errors: int
    checksum_failures: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    sessions: int
    pins: int
    acquires: int
    capacity_exhausted: int
    acquire_latency_mean_us: float
    read_latency_mean_us: float
    loads_in_flight: int
    reads: int
    demotions: int
    d2h_bytes: int
    fence_waits: int
    fence_revocations: int
    hits_verified: int
    hit_mismatches: int
    figures: _containers.ScalarMap[str, float]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., bytes_read: _Optional[int] = ..., h2d_bytes: _Optional[int] = ..., io_errors: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., prefetch_issued: _Optional[int] = ..., prefetch_used: _Optional[int] = ..., prefetch_wasted: _Optional[int] = ..., sessions: _Optional[int] = ..., pins: _Optional[int] = ..., acquires: _Optional[int] = ..., capacity_exhausted: _Optional[int] = ..., acquire_latency_mean_us: _Optional[float] = ..., read_latency_mean_us: _Optional[float] = ..., loads_in_flight: _Optional[int] = ..., reads: _Optional[int] = ..., demotions: _Optional[int] = ..., d2h_bytes: _Optional[int] = ..., fence_waits: _Optional[int] = ..., fence_revocations: _Optional[int] = ..., hits_verified: _Optional[int] = ..., hit_mismatches: _Optional[int] = ..., figures: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "hits", "misses", "evictions", "resident_experts", "resident_bytes", "capacity_slots", "coalesced")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    hits: int
    misses: int
    evictions: int
    resident_experts: int
    resident_bytes: int
    capacity_slots: int
    coalesced: int
    def __init__(self, tier: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., resident_experts: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., capacity_slots: _Optional[int] = ..., coalesced: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
