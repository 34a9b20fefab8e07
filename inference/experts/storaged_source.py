"""StoragedExpertSource: expert objects served by the storaged daemon, as views of its shared arena.

    source = StoragedExpertSource("/run/expertpack/storaged.sock", "qwen3-30b", bundle, "cuda:0")
    objects = source.acquire(layer, [5, 17, 40])   # uint8 views into the daemon's slots

Attach maps the daemon's arena once (a sealed memfd, read-only, on a CPU daemon; a CUDA IPC
allocation on a GPU daemon); each `acquire` is one message each way on the session's Acquire stream and returns
views of the slots' bytes: no copy when the arena lives on the compute device, one copy otherwise.

Lifetime of the views: every Acquire sets `release_other_layers`, so storaged keeps pinned only
the layer being computed, and the cache needs room for one layer's demand rather than every
layer's at once (a long prompt touches every expert of every layer: the whole model). So,
stricter than the ExpertSource protocol: the views of one `acquire` may be overwritten after the
next one. That is safe because the experts forward reads the views only while it computes that
layer (it gathers them into fresh tensors first); the one hazard is work still queued on a CUDA
stream, hence `acquire` synchronizes the current stream before asking for more slots (cheap: the
forward has just synchronized to read the routing ids). A CPU forward is synchronous.
A layer whose own demand does not fit (the cache is smaller than that layer's distinct experts,
or other sessions pin the rest) fails with ExpertCapacityError; nothing is retried.

At attach the daemon's model is checked to be the very bundle loaded here: model type, MoE
layers, experts per layer, every object's size and role entries, the manifest's pack index
checksum and config hash when the daemon's bundle directory is readable here, and the checksum
of one object read through the arena. A mismatch raises StoragedBundleMismatchError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import zlib
from collections.abc import Sequence

import torch

from inference.experts.errors import ExpertLayoutError, ExpertsError
from inference.experts.host_reads import HostReads
from inference.experts.source import SlotRows, rows_of_objects, uniform_layout
from inference.kernels.ops import HostSlots
from packformat import RoleEntry
from packformat.bundle import MANIFEST, Bundle
from storaged.client import (CapacityExhausted, ClientClosed, NotFound, Session, StatusCode, StorageClient,
                             StorageError, Unavailable)
from storaged.device.errors import ArenaError

log = logging.getLogger(__name__)


class StoragedBundleMismatchError(ExpertsError):
    """storaged serves another bundle under the model name than the one this process loaded."""

    def __init__(self, socket_path: str, model: str, problem: str):
        super().__init__(f"storaged at {socket_path} model {model!r}: {problem}")
        self.socket_path = socket_path
        self.model = model


@dataclasses.dataclass(frozen=True)
class ResidentLookup:
    """Where a layer's resident experts are: `rows[layer]`, int32 [E] on the compute device (the
    slot of each expert, -1 when absent), in `arena` (uint8) of `stride` bytes per slot;
    `complete`: the layers whose every expert was resident when the step opened (they stay so
    until it finishes, so their experts need no look at the routing on the host).

    With `host` (inference.experts.host_reads), `rows` also name host-tier slots (ids from
    host.first on, for the fused GEMV only) and `complete` counts them; `vram_rows` and
    `complete_vram` are the same of the slot map alone (for the grouped GEMM and the gather path).
    """

    rows: dict[int, torch.Tensor]
    arena: torch.Tensor
    stride: int
    complete: frozenset[int] = frozenset()
    vram_rows: dict[int, torch.Tensor] | None = None  # None: rows (no host tier read in place)
    complete_vram: frozenset[int] | None = None  # None: complete
    host: HostSlots | None = None

    def vram(self) -> tuple[dict[int, torch.Tensor], frozenset[int]]:
        """(rows, complete) of the slot map alone."""
        if self.vram_rows is None:
            return self.rows, self.complete
        return self.vram_rows, self.complete_vram


class ResidentStepRevokedError(Unavailable):
    """storaged revoked the step fence under which a forward read resident experts (the step
    outlived its fence timeout): the forward's output may come from overwritten slots."""


class StoragedSessionLostError(Unavailable):
    """The daemon no longer knows this session (it restarted): reconnect() opens a new one."""


class ExpertCapacityError(CapacityExhausted):
    """One layer needs more slots at once than the daemon's cache has free for this session (its
    whole cache, less what other sessions pin)."""


def _role_entries(layout) -> tuple[RoleEntry, ...]:
    """storaged.client RoleLayouts -> packformat RoleEntries (the fields the pack index records)."""
    return tuple(RoleEntry(r.role, r.element_type, r.offset, r.nbytes, tuple(r.shape)) for r in layout.roles)


def layout_mismatch(bundle: Bundle, model_type: str, layers: dict) -> str | None:
    """What differs between the bundle's pack index and a session's layout, or None."""
    pack = bundle.pack
    if model_type != bundle.config.get("model_type"):
        return f"model_type is {model_type!r} there, {bundle.config.get('model_type')!r} here"
    if sorted(layers) != list(pack.layers):
        return f"MoE layers are {sorted(layers)} there, {list(pack.layers)} here"
    for layer in pack.layers:
        served = layers[layer]
        if served.expert_count != pack.header.expert_count:
            return f"layer {layer} has {served.expert_count} experts there, {pack.header.expert_count} here"
        for expert in range(pack.header.expert_count):
            entry, there = pack.entry(layer, expert), served.object(expert)
            if there.object_bytes != entry.size:
                return f"layer {layer} expert {expert}: object is {there.object_bytes} bytes there, {entry.size} here"
            if _role_entries(there) != entry.roles:
                return f"layer {layer} expert {expert}: roles {_role_entries(there)} there, {entry.roles} here"
    return None


def manifest_mismatch(bundle: Bundle, served_path: str) -> str | None:
    """Compares the pack index checksum and config hash when the daemon's manifest is readable here
    (a daemon in another mount namespace may name a path this process cannot see)."""
    try:
        with open(f"{served_path}/{MANIFEST}", encoding="utf-8") as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        return None
    ours = bundle.manifest
    for what, there, here in (("pack index crc32", theirs.get("pack", {}).get("index_crc32"),
                                ours.get("pack", {}).get("index_crc32")),
                               ("config sha256", theirs.get("config_sha256"), ours.get("config_sha256"))):
        if there != here:
            return f"{what} of {served_path} is {there!r}, of {bundle.path} {here!r}"
    return None


class StoragedExpertSource:
    """An ExpertSource backed by storaged, with the engine's optional hooks (see
    inference.engine.source_hooks): expert_wait_seconds, is_available, connection_problem, reconnect.

    `connect_timeout`: seconds to wait for the daemon to report SERVING first (0: fail at once when
    it is not up). Raises storaged.client errors (Unavailable, NotFound...) or
    StoragedBundleMismatchError when the session cannot be opened.
    """

    def __init__(self, socket_path: str, model_name: str, bundle: Bundle, device: torch.device | str, *,
                 connect_timeout: float = 0.0, rpc_timeout: float = 60.0, probe_timeout: float = 1.0,
                 host_reads: bool = True):
        self.socket_path = str(socket_path)
        self.model_name = model_name
        self.bundle = bundle
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compared with the arena's device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rpc_timeout = rpc_timeout  # seconds for unary calls (Attach, Info, Detach)
        self.probe_timeout = probe_timeout  # seconds is_available may take
        # read the daemon's host tier in place on CUDA (inference.experts.host_reads), when it shares one
        self.host_reads = host_reads
        self._host_reads: tuple[Session, HostReads | None] | None = None  # per session, built on first use
        self._layouts = {layer: uniform_layout(bundle, layer) for layer in bundle.pack.layers}
        self._state_lock = threading.Lock()  # client/session swaps vs is_available on other threads
        self._wait_lock = threading.Lock()
        self._wait_seconds = 0.0
        self._client: StorageClient | None = None
        self._session: Session | None = None
        self._resident_fence = None  # the step fence this source opened for resident_lookup, while open
        self._resident: ResidentLookup | None = None
        # the model's forward hook ends the resident step; the forwards of a batch step
        # (inference.engine.batch) run on several threads and each ends it: only the first may
        self._resident_end_lock = threading.Lock()
        self._connect(connect_timeout)

    # --- connection -----------------------------------------------------------------------------

    def _connect(self, wait_seconds: float) -> None:
        client = StorageClient(self.socket_path, timeout=self.rpc_timeout)
        try:
            if wait_seconds > 0:
                client.wait_until_serving(wait_seconds)
            models = client.info().models
            served = models.get(self.model_name)
            if served is None:
                raise NotFound(StatusCode.NOT_FOUND, f"model {self.model_name!r} is not served by "
                               f"{self.socket_path} (served: {', '.join(sorted(models))}); name the "
                               "daemon's model with --storaged-model", rpc="Info")
            session = client.attach(self.model_name)
            try:
                problem = (layout_mismatch(self.bundle, served.model_type, session.layers)
                           or manifest_mismatch(self.bundle, served.bundle_path)
                           or self._probe_mismatch(session))
                if problem is not None:
                    raise StoragedBundleMismatchError(
                        self.socket_path, self.model_name,
                        f"serves {served.bundle_path}, not the bundle loaded here ({self.bundle.path}): {problem}")
            except BaseException:
                session.close()
                raise
        except BaseException:
            client.close()
            raise
        with self._state_lock:
            self._client, self._session = client, session
        log.info("attached to storaged %s model %r: %d slots of %d bytes on %s", self.socket_path,
                 self.model_name, session.slot_count, session.slot_size, session.arena.device)

    def _probe_mismatch(self, session: Session) -> str | None:
        """Reads one object through the arena and compares its checksum with our pack index."""
        layer = self.bundle.pack.layers[0]
        entry = self.bundle.pack.entry(layer, 0)
        (slot,) = session.acquire(layer, [0])
        payload = session.slot_bytes(slot, entry.size).cpu().numpy()  # uint8 [size]; CUDA: copied
        crc = zlib.crc32(payload)
        session.release(layer)
        if crc != entry.crc32:
            return f"layer {layer} expert 0 has crc32 {crc:#010x} there, {entry.crc32:#010x} here"
        return None

    def _disconnect(self) -> None:
        with self._state_lock:
            client, session = self._client, self._session
            self._client = self._session = None
        if session is not None:
            try:
                session.close()
            except (StorageError, ClientClosed):
                pass  # the daemon is gone or forgot the session: nothing left to free there
        if client is not None:
            client.close()

    def reconnect(self) -> None:
        """Open a new session (a new client channel, a new arena mapping), e.g. after the daemon
        restarted; raises Unavailable while it is still down. A fresh channel is used because the
        old one may sit in gRPC's reconnect back-off for seconds after the daemon is back."""
        self._sync_device(raise_revoked=False)
        self._disconnect()
        self._connect(wait_seconds=0.0)

    def connection_problem(self) -> str | None:
        """Why this source cannot serve from its current session, or None while the session's
        connection is open (thread-safe, instant: nothing is sent). A lost connection (the daemon
        stopped or restarted, even while idle) is the engine's cue to reconnect before a request."""
        with self._state_lock:
            session = self._session
        if session is None:
            return f"no session with storaged at {self.socket_path} (the last reconnect failed)"
        lost = session.connection_lost()
        if lost is not None:
            return f"storaged at {self.socket_path}: {lost} (it stopped or restarted)"
        return None

    def is_available(self) -> bool:
        """Whether the daemon answers its health check as SERVING (thread-safe; at most probe_timeout)."""
        with self._state_lock:
            client = self._client
        if client is None:
            return False
        try:
            client.wait_until_serving(self.probe_timeout)
        except (StorageError, ClientClosed, ValueError):  # ValueError: channel closed by a reconnect
            return False
        return True

    def close(self) -> None:
        """End the session (storaged releases its pins) and the connection. Idempotent."""
        self._sync_device(raise_revoked=False)
        self._disconnect()

    # --- the ExpertSource protocol ----------------------------------------------------------------

    def layout(self, layer: int) -> tuple[RoleEntry, ...]:
        if layer not in self._layouts:
            raise ExpertLayoutError(layer, f"{self.bundle.pack.path} has no routed experts for this layer "
                                    f"(its layers: {list(self._layouts)})")
        return self._layouts[layer]

    def acquire(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        started = time.perf_counter()
        try:
            return self._acquire(layer, experts)
        finally:
            elapsed = time.perf_counter() - started
            with self._wait_lock:
                self._wait_seconds += elapsed

    def expert_wait_seconds(self) -> float:
        """Seconds spent in acquire since this source was made (on CUDA: until the copies were
        queued on the stream, not until they completed)."""
        with self._wait_lock:
            return self._wait_seconds

    def _acquire(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        session, slots = self._acquired_slots(layer, experts)
        layer_layout = session.layers[layer]
        objects = []
        for expert, slot in zip(experts, slots, strict=True):
            view = session.slot_bytes(slot, layer_layout.object(expert).object_bytes)  # uint8 [object bytes]
            objects.append(view if view.device == self.device else view.to(self.device))
        return objects

    def acquire_rows(self, layer: int, experts: list[int]) -> SlotRows:
        """The experts' slots as rows of the shared arena (no copy when the arena lives on the
        compute device): kernels read the objects in place. Valid until the next acquire."""
        started = time.perf_counter()
        try:
            session, slots = self._acquired_slots(layer, experts)
            arena = session.arena.slots()  # uint8 [slot_count * slot_bytes]
            if arena.device == self.device:
                return SlotRows(arena, session.slot_size, tuple(slots))
            return rows_of_objects(self._acquire_views(session, layer, experts, slots))
        finally:
            with self._wait_lock:
                self._wait_seconds += time.perf_counter() - started

    def _acquire_views(self, session: Session, layer: int, experts: list[int], slots: list[int]) -> list[torch.Tensor]:
        layout = session.layers[layer]
        return [session.slot_bytes(slot, layout.object(e).object_bytes).to(self.device)
                for e, slot in zip(experts, slots, strict=True)]

    def _acquired_slots(self, layer: int, experts: list[int]) -> tuple[Session, list[int]]:
        session = self._session
        if session is None:
            raise Unavailable(StatusCode.UNAVAILABLE, f"no session with {self.socket_path} "
                              "(the last reconnect failed)", rpc="Acquire")
        self._sync_device()  # this Acquire frees every other layer's slots: no queued work may read them
        stream = torch.cuda.current_stream(session.arena.device) if session.arena.device.type == "cuda" else None
        try:
            return session, self._acquire_slots(session, layer, experts, stream)
        except NotFound as exc:
            raise StoragedSessionLostError(exc.code, f"{exc.details}; storaged at {self.socket_path} "
                                           "probably restarted", rpc=exc.rpc) from exc

    def max_pinned(self) -> int | None:
        """The most experts one acquire can hold: the daemon's slots (a layer touching more is
        computed in groups, inference.experts.forward)."""
        session = self._session
        return session.slot_count if session is not None else None

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Hint that `experts` of `layer` will be wanted soon (lookahead); does not wait."""
        session = self._session
        if session is not None and experts:
            session.prefetch(layer, experts)

    # --- reading the slot map on the device (inference.engine.decode_graph) ----------------------

    def device_lookup(self):
        """(slot map [rows, experts] int32, row of each MoE layer, arena slots uint8, slot bytes,
        step fence, HostReads or None), or None when the daemon publishes no map, offers no data
        plane, or keeps its arena on another device than the model's."""
        session = self._session
        if session is None or session.fence is None:
            return None
        slot_map = session.slot_map()
        if slot_map is None or slot_map.device != self.device:
            return None
        rows = {layer: session.slot_map_view.row(layer) for layer in session.slot_map_view.layers}
        arena = session.arena.slots()
        return slot_map, rows, arena, session.slot_size, session.fence, self._host_reads_of(session, arena)

    def _host_reads_of(self, session: Session, arena: torch.Tensor) -> HostReads | None:
        """The session's HostReads (its host tier mapped and registered on first use), or None: off,
        the daemon shares no host tier, or it cannot be mapped here (logged once: the host tier's
        experts are then copied up by the daemon, as without host_reads)."""
        cached = self._host_reads
        if cached is not None and cached[0] is session:
            return cached[1]
        reads = None
        host_map = session.host_map() if self.host_reads else None
        if host_map is not None:
            try:
                tier = session.host_tier()
                if tier is not None:
                    # where the kernels find host slot 0: registered with the device on CUDA (read
                    # over the link), the mapping itself on the CPU (the fused kernels under
                    # triton's interpreter)
                    address = (tier.device_address(self.device) if self.device.type == "cuda"
                               else tier.slot_view(0).data_ptr())
                    reads = HostReads(host_map, HostSlots(session.slot_count, address - arena.data_ptr()),
                                      tier.slot_view(0).data_ptr(), tier.slot_count)
                    log.info("storaged's host tier mapped to be read in place (%d slots of %d bytes)",
                             tier.slot_count, tier.slot_bytes)
            except (StorageError, ArenaError) as exc:  # ArenaError: mapping, or CUDA registration
                log.warning("storaged's host tier cannot be read in place here (%s); its experts are copied up "
                            "to VRAM by Acquires instead", exc)
        self._host_reads = (session, reads)
        return reads

    def _acquire_slots(self, session: Session, layer: int, experts: Sequence[int], stream) -> list[int]:
        # The caller has synchronized the device: no queued work reads another layer's views.
        try:
            return session.acquire(layer, experts, stream=stream, release_other_layers=True)
        except CapacityExhausted as exc:
            raise ExpertCapacityError(
                exc.code, f"layer {layer} needs {len(experts)} experts pinned at once ({len(experts)} x "
                f"{session.slot_size} bytes) but storaged at {self.socket_path} has {session.slot_count} slots "
                f"in all, other sessions' pins included ({exc.details}); raise its vram_cache_bytes",
                rpc=exc.rpc) from exc

    def _sync_device(self, *, raise_revoked: bool = True) -> None:
        session = self._session
        if session is not None and session.arena.device.type == "cuda":
            torch.cuda.current_stream(session.arena.device).synchronize()
        try:
            self._finish_resident_step()
        except ResidentStepRevokedError:
            if raise_revoked:
                raise

    # --- resident lookup: compute a layer whose experts are all resident without an Acquire -------

    def resident_lookup(self) -> ResidentLookup | None:
        """The slot map's rows, the arena and its stride, with the session's step fence STARTED
        (if it was not already by this source): a slot read from the map now is not reused until
        `finish_resident_step` (or the next acquire, which calls it). None when the daemon
        publishes no map on this device, or the fence is held by someone else (a decode step) or
        was revoked: then acquire as usual."""
        if self._resident_fence is not None:
            return self._resident
        session = self._session
        lookup = self.device_lookup() if session is not None else None
        if lookup is None:
            return None
        slot_map, rows, arena, stride, fence, host = lookup
        if fence.open or fence.revoked:
            return None
        fence.begin()
        self._resident_fence = fence
        # read after begin(): a slot seen here is not reused before the step finishes
        if host is None:
            resident = (slot_map >= 0).all(dim=1).tolist()  # [rows] one host sync per step
            complete = frozenset(layer for layer, row in rows.items() if resident[row])
            self._resident = ResidentLookup({layer: slot_map[row] for layer, row in rows.items()}, arena, stride,
                                            complete)
            return self._resident
        merged = host.merge(slot_map)  # [rows, E] both tiers
        resident, in_vram = torch.stack([(merged >= 0).all(dim=1), (slot_map >= 0).all(dim=1)]).tolist()  # one sync
        self._resident = ResidentLookup(
            {layer: merged[row] for layer, row in rows.items()}, arena, stride,
            frozenset(layer for layer, row in rows.items() if resident[row]),
            {layer: slot_map[row] for layer, row in rows.items()},
            frozenset(layer for layer, row in rows.items() if in_vram[row]), host.slots)
        return self._resident

    def finish_resident_step(self) -> None:
        """Wait for the device work queued under the open resident step, then mark it finished
        (nothing to do when none is open). Raises ResidentStepRevokedError when the daemon stopped
        waiting for it: that work may have read overwritten slots, its results must not be used."""
        with self._resident_end_lock:
            if self._resident_fence is None:
                return
            session = self._session
            if session is not None and session.arena.device.type == "cuda":
                torch.cuda.current_stream(session.arena.device).synchronize()
            self._finish_resident_step()

    def _finish_resident_step(self) -> None:
        # the caller synchronized the device: the step's work has completed
        fence, self._resident_fence, self._resident = self._resident_fence, None, None
        if fence is None:
            return
        from storaged.client.dataplane import FenceRevoked

        try:
            fence.end()
        except FenceRevoked as exc:
            raise ResidentStepRevokedError(exc.code, f"{exc.details}; the forward that read resident experts "
                                           "is void", rpc=exc.rpc) from exc
        except ValueError:  # the fence page was unmapped by a reconnect meanwhile: nothing to mark
            pass
