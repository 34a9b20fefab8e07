"""The data path: policy plan → pack read → copy into the slot → publish, with single flight.

Every load runs in its own task, independent of the request that started it: a client that
goes away mid-load does not cancel a read other sessions may be waiting for. A load resolves
two futures: `issued` (the copy into the slot was issued; its result is the ready-event index,
or None when the copy was already complete) and `done` (the slot is published in the policy).
The requester that started a load replies at `issued` with the event index; requests that
joined the load (Source.WAIT) reply at `done`, when the slot is complete. Nothing is
published (planner.complete, and the slot map entry) before its copy has completed, so a later
hit, through Acquire or through the map on the device, needs no event.

With verify_hits (hit_verify.py), a sample of the hits is re-checked against the object's crc32
before the reply; one whose bytes changed is never served: it goes back to LOADING in its slot
(its map entry cleared, the step fences honoured) and is read from the pack again, and this
request, like any other that wants it, waits for that load (DATA_LOSS if the pack's copy is bad).

A slot taken from a victim is written only after (1) the victim's slot map entry was cleared
and (2) every session that was mid-step when it was cleared finished that step (fences.py):
a client reading the map on the device never sees a slot change under a step. A victim with a
place in the host tier is first copied down (a demotion); the arena orders the overwrite after
it on the device, so the overwrite needs no host wait of its own.

Clients also read host-tier objects in place (the arena's host map, published when a demotion's
copy completed). A host slot is reused only by a demotion, and under the same rule: the evicted
entry's host map entry is cleared with the plan's VRAM victims, and when a session that may have
read it is still mid-step, the demotion's copy waits for that step to finish, and the load into
the VRAM slot it empties waits for that copy to be issued (the arena orders the two on the device).

Runs on the event loop thread only, like the planner it drives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from packformat.errors import ObjectChecksumError
from storaged.device.arena import Arena, CopyHandle
from storaged.device.errors import ArenaClosedError
from storaged.device.host_tier import HostTier
from storaged.io.executor import ReadExecutor, ReadPriority
from storaged.io.staging import StagingPool
from storaged.metrics import StoragedMetrics
from storaged.policy import (AcquirePlanner, Demotion, EntryState, Eviction, ExpertKey, ExpertStep,
                             PreloadOutcome, SlotMapLayout, SlotsExhausted, Source)
from storaged.server.fences import FenceTable, Snapshot
from storaged.server.hit_verify import HitVerifier
from storaged.server.models import ServedModel
from storaged.server.sessions import ServerSession

NO_EVENT = -1  # ready_events value of a slot whose bytes are already complete
PRELOAD_BUSY_POLL_SECONDS = 0.05
PRELOAD_BUSY_POLLS = 200  # 10 s of every VRAM slot held by requests: the preload gives up


class LoadError(Exception):
    """A load failed; every request waiting for that expert fails with it."""


class ObjectDataLoss(LoadError):
    """The object's bytes failed their checksum: the slot was not published."""


class ObjectReadFailed(LoadError):
    """The OS failed the read (EIO, short read...): the slot was not published."""


class EmptyRequest(ValueError):
    """An Acquire or Prefetch named no experts."""


class TooManyIds(ValueError):
    """A Prefetch named more experts than max_ids_per_acquire."""


def _consume_exception(future: asyncio.Future) -> None:
    # A load's futures may fail with nobody awaiting them (e.g. a prefetch); mark them seen.
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True)
class _Reuse:
    """What the overwrite of a VRAM victim's slot waits for: the fence snapshot taken when the
    victim's entries were cleared, and the victim's demotion when its copy was held back."""

    snapshot: Snapshot
    demotion_issued: asyncio.Future | None = None  # → None once the copy out of the slot is issued


@dataclass
class PreloadReport:
    """What StorageEngine.preload read: experts whose loads completed, and those that failed."""

    loaded: int = 0
    failed: int = 0
    # why it ended before the last expert: "full" (neither tier has room), "busy" (requests held
    # every VRAM slot for PRELOAD_BUSY_POLLS polls); "" when every expert was considered
    stopped: str = ""

    def count(self, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            self.failed += 1
        else:
            self.loaded += 1


@dataclass(eq=False)
class _Load:
    key: ExpertKey
    priority: ReadPriority
    issued: asyncio.Future  # → event index (int) or None once the copy into the slot is issued
    done: asyncio.Future  # → slot once published
    read: concurrent.futures.Future | None = None  # the queued pack read, while there is one
    resubmit: bool = field(default=False)  # the read was cancelled to requeue it as DEMAND


class StorageEngine:
    """Serves Acquire and Prefetch for all sessions from one arena and one planner."""

    def __init__(self, planner: AcquirePlanner, arena: Arena,
                 staging: StagingPool, executor: ReadExecutor, metrics: StoragedMetrics, *,
                 host_tier: HostTier | None = None, max_ids: int, slot_map: SlotMapLayout,
                 fences: FenceTable, sizes: dict[int, ServedModel], verifier: HitVerifier | None = None):
        self.planner = planner
        self.arena = arena
        self.staging = staging
        self.executor = executor
        self.metrics = metrics
        self.host_tier = host_tier
        self.max_ids = max_ids
        self.slot_map = slot_map
        self.fences = fences
        self.verifier = verifier
        self._models = sizes  # model id → ServedModel, for object sizes of demotions
        self._loads: dict[ExpertKey, _Load] = {}
        self._demotions: dict[ExpertKey, asyncio.Future] = {}  # → None once the host copy is complete
        # reloads of altered hits completed, per key: a verification that began before one ended
        # saw the old bytes, and must not reload again
        self._reloaded: dict[ExpertKey, int] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    # ---- requests ----------------------------------------------------------------------------

    async def acquire(self, session: ServerSession, layer: int, experts: tuple[int, ...], *,
                      release_other_layers: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(slots, ready_events) in request order; pins replace the session's pins on `layer`
        (and, with `release_other_layers`, its pins on every other layer of the model)."""
        if not experts:
            raise EmptyRequest(f"session {session.id}: Acquire of layer {layer} names no experts "
                               "(use Release to drop a layer's pins)")
        started = time.perf_counter()
        model = session.model
        try:
            plan = self.planner.acquire(session.id, model.model_id, layer, experts,
                                        release_other_layers=release_other_layers)
        except SlotsExhausted:
            self.metrics.add("capacity_exhausted_total")
            raise
        planned = time.perf_counter()
        events = [NO_EVENT] * len(plan.steps)
        own_loads: list[tuple[int, asyncio.Future]] = []  # → event index of the copy, or None
        joined: list[asyncio.Future] = []  # → slot, once another request's load is published
        reused = self._retire(plan.evictions, plan.demotions)
        unmapped = time.perf_counter()
        for index, step in enumerate(plan.steps):
            if step.source is Source.WAIT:
                load = self._loads[step.key]
                if step.promote:
                    self._promote(load)
                joined.append(load.done)
            elif step.source.needs_io:
                load = self._start_load(step, model, ReadPriority.DEMAND, reused.get(step.slot))
                own_loads.append((index, load.issued))
        if self.verifier is not None:
            reloaded = {step.key: self._reloaded.get(step.key, 0) for step in plan.steps}
            for index, step in await self.verifier.failures(plan.steps, model.pack):
                if self._reloaded.get(step.key, 0) != reloaded[step.key]:
                    continue  # reloaded (and checked against its checksum) while this one hashed
                load, own = self._reload(step, model)
                if own:
                    own_loads.append((index, load.issued))
                else:
                    joined.append(load.done)
        # Shielded: a request cancelled while waiting (its client left) must not cancel the
        # load's futures, which other requests and the load task itself still use.
        for index, issued in own_loads:
            event = await asyncio.shield(issued)
            events[index] = NO_EVENT if event is None else event
        issued_at = time.perf_counter()
        for done in joined:
            await asyncio.shield(done)
        ended = time.perf_counter()
        self.metrics.observe_acquire(ended - started)
        self.metrics.observe_acquire_phases(plan=planned - started, unmap=unmapped - planned,
                                            issue=issued_at - unmapped, join=ended - issued_at)
        return plan.slots, tuple(events)

    def prefetch(self, session: ServerSession, layer: int, experts: tuple[int, ...]) -> int:
        """Start low-priority loads for hinted experts; returns how many were started."""
        if not experts:
            raise EmptyRequest(f"session {session.id}: Prefetch of layer {layer} names no experts")
        if len(experts) > self.max_ids:
            raise TooManyIds(f"session {session.id} layer {layer}: {len(experts)} experts hinted, "
                             f"at most {self.max_ids} per call")
        plan = self.planner.prefetch(session.model.model_id, layer, experts)
        reused = self._retire(plan.evictions, plan.demotions)
        for step in plan.loads:
            self._start_load(step, session.model, ReadPriority.PREFETCH, reused.get(step.slot))
        return len(plan.loads)

    async def preload(self, models: Sequence[ServedModel]) -> PreloadReport:
        """Fill VRAM, then the host tier, with experts read from the packs, at prefetch priority
        (a demand read goes first; an Acquire joining a preload promotes it), until neither tier
        has room: every model's MoE layers in turn, expert ids in order, so each layer gets an
        equal share. Failed loads are counted and skipped; requests are served meanwhile."""
        order = [(model, layer, expert) for expert in range(max((m.expert_count for m in models), default=0))
                 for model in models if expert < model.expert_count for layer in model.moe_layers]
        report = PreloadReport()
        in_flight: set[asyncio.Future] = set()
        self.metrics.set("preloading", 1)
        try:
            for model, layer, expert in order:
                polls = 0
                while True:
                    outcome, plan = self.planner.preload(model.model_id, layer, expert)
                    if outcome is not PreloadOutcome.BUSY:
                        break
                    if in_flight:  # room comes back as one of its own loads completes
                        _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    elif polls < PRELOAD_BUSY_POLLS:  # requests' loads or pins hold every VRAM slot
                        polls += 1
                        await asyncio.sleep(PRELOAD_BUSY_POLL_SECONDS)
                    else:
                        break
                if outcome is not PreloadOutcome.LOADED and outcome is not PreloadOutcome.PRESENT:
                    report.stopped = outcome.value
                    break
                if plan is None:  # PRESENT
                    continue
                reused = self._retire(plan.evictions, plan.demotions)
                for step in plan.loads:
                    load = self._start_load(step, model, ReadPriority.PREFETCH, reused.get(step.slot))
                    load.done.add_done_callback(report.count)
                    in_flight.add(load.done)
                    self.metrics.add("preload_loads_total")
            if in_flight:
                await asyncio.wait(in_flight)
        finally:
            self.metrics.set("preloading", 0)
        return report

    def release(self, session: ServerSession, layer: int | None) -> int:
        """Unpin the session's slots on `layer` (InvalidLayer unless a MoE layer), or all of them."""
        if layer is not None:
            self.planner.validate_layer(session.model.model_id, layer)
        return self.planner.release(session.id, layer, model=session.model.model_id)

    def close_session(self, session: ServerSession) -> int:
        return self.planner.close_session(session.id)

    def _reload(self, step: ExpertStep, model: ServedModel) -> tuple[_Load, bool]:
        """A hit whose bytes failed verification: load it again in its slot, or join the reload
        another request started; → (the load, whether this call started it)."""
        key = step.key
        load = self._loads.get(key)
        if load is not None:
            return load, False
        vram = self.planner.vram
        if vram.state(key) is not EntryState.READY or vram.slot_of(key) != step.slot:
            # its pins were dropped meanwhile (a failed reload, or the session released them)
            raise ObjectDataLoss(f"(layer {key.layer}, expert {key.expert}): its cached copy failed verification "
                                 "and is no longer resident")
        reload = self.planner.reload(key)
        self.arena.unpublish([self.slot_map.index(key)])  # visible on return
        load = self._start_load(reload, model, ReadPriority.DEMAND, _Reuse(self.fences.snapshot()))
        load.done.add_done_callback(
            lambda done: not done.cancelled() and done.exception() is None and self._count_reload(key))
        return load, True

    def _count_reload(self, key: ExpertKey) -> None:
        self._reloaded[key] = self._reloaded.get(key, 0) + 1

    # ---- victims -----------------------------------------------------------------------------

    def _retire(self, evictions: tuple[Eviction, ...], demotions: tuple[Demotion, ...]) -> dict[int, _Reuse]:
        """Unmap a plan's VRAM victims (and the host map entries of the host entries its demotions
        evict), start the demotions; → {reused VRAM slot: what its overwrite must wait for}."""
        vram_tier = self.planner.vram.tier
        victims = [e for e in evictions if e.tier == vram_tier]
        if not victims:
            return {}
        indices = [self.slot_map.index(e.key) for e in victims]
        host_victims = set()
        if self.arena.host_slots:
            for e in evictions:
                if e.tier != vram_tier:
                    indices.append(self.arena.host_index(self.slot_map.index(e.key)))
                    host_victims.add(e.slot)
        self.arena.unpublish(indices)  # visible on return
        snapshot = self.fences.snapshot()  # sessions that may have read the old entries
        held = bool(host_victims) and not FenceTable.quiesced(snapshot)
        reuse = {e.slot: _Reuse(snapshot) for e in victims}
        for demotion in demotions:
            if held and demotion.host_slot in host_victims:
                reuse[demotion.vram_slot] = _Reuse(snapshot, self._start_demotion(demotion, snapshot))
            else:
                self._start_demotion(demotion)
        return reuse

    def _start_demotion(self, demotion: Demotion, snapshot: Snapshot | None = None) -> asyncio.Future | None:
        """Copy a VRAM victim down to its host slot: at once (→ None), or, with `snapshot`, once
        every session in it finished its step (→ a future resolved when the copy is issued)."""
        assert self.host_tier is not None
        key = demotion.key
        nbytes = self._models[key.model].pack.entry(key.layer, key.expert).size
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(_consume_exception)
        self._demotions[key] = future
        issued = loop.create_future() if snapshot is not None else None

        def issue() -> CopyHandle | None:
            try:
                # Queued before any copy into the VRAM slot: the arena runs them in that order.
                handle = self.arena.copy_out(demotion.vram_slot, self.host_tier.slot(demotion.host_slot), nbytes)
            except Exception as exc:  # noqa: BLE001 - a failed demotion only loses a cached copy
                self._end_demotion(key, future, exc)
                return None
            finally:
                if issued is not None:
                    issued.set_result(None)
            self.metrics.record_demotion(nbytes)
            return handle

        handle = issue() if snapshot is None else None
        if snapshot is None and handle is None:
            return None

        async def finish(handle: CopyHandle | None) -> None:
            if handle is None:  # held back: a session may still read the host slot's old object
                await self.fences.wait_quiesced(snapshot)
                handle = issue()
                if handle is None:
                    return
            try:
                await handle.wait()
            except Exception as exc:  # noqa: BLE001
                self._end_demotion(key, future, exc)
            else:
                self._end_demotion(key, future, None)

        task = loop.create_task(finish(handle), name=f"demotion {key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return issued

    def _end_demotion(self, key: ExpertKey, future: asyncio.Future, error: Exception | None) -> None:
        if self._demotions.get(key) is future:
            del self._demotions[key]
        if error is None:
            host_slot = self.planner.demoted(key)
            if self.arena.host_slots:  # clients may read it in place from now on
                with contextlib.suppress(ArenaClosedError):
                    self.arena.publish(self.arena.host_index(self.slot_map.index(key)), host_slot)
            future.set_result(None)
        else:
            self.planner.demotion_failed(key)
            future.set_exception(ObjectReadFailed(f"demotion of {key} to the host tier failed: {error}"))

    # ---- loads -------------------------------------------------------------------------------

    def _start_load(self, step: ExpertStep, model: ServedModel, priority: ReadPriority,
                    reuse: _Reuse | None = None) -> _Load:
        loop = asyncio.get_running_loop()
        load = _Load(step.key, priority, loop.create_future(), loop.create_future())
        for future in (load.issued, load.done):
            future.add_done_callback(_consume_exception)
        self._loads[step.key] = load
        demotion = self._demotions[step.key] if step.after_demotion else None  # taken now: it may end first
        handle = None
        if step.source is Source.HOST and self._nothing_to_wait_for(demotion, reuse):
            # The common promotion: its bytes are in the host tier and nothing orders it, so the
            # copy is issued now and the Acquire that asked for it finds it issued without
            # yielding to the loop (a task per copy cost ~0.1 ms a promotion in scheduling).
            try:
                handle = self._issue_copy(load, step, model, self.host_tier.slot(step.host_slot))
            except Exception as exc:  # noqa: BLE001 - as in _run_load: fail the waiters, not hang them
                self._fail(load, ObjectReadFailed(f"load of {step.key} failed: {exc}"))
                return load
        task = loop.create_task(self._run_load(load, step, model, reuse, demotion, handle),
                                name=f"load {step.key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return load

    @staticmethod
    def _nothing_to_wait_for(demotion: asyncio.Future | None, reuse: _Reuse | None) -> bool:
        """No demotion still copying the object down, no session that may still read the slot,
        no held-back copy out of the slot still to be issued."""
        demoted = demotion is None or (demotion.done() and not demotion.cancelled() and demotion.exception() is None)
        if reuse is None:
            return demoted
        return (demoted and FenceTable.quiesced(reuse.snapshot)
                and (reuse.demotion_issued is None or reuse.demotion_issued.done()))

    def _issue_copy(self, load: _Load, step: ExpertStep, model: ServedModel, source) -> CopyHandle:
        nbytes = model.pack.entry(step.key.layer, step.key.expert).size
        handle = self.arena.copy_in(step.slot, source, nbytes)
        self.metrics.record_h2d(nbytes)
        load.issued.set_result(handle.event_index)
        return handle

    def _promote(self, load: _Load) -> None:
        """A demand joined a prefetch: requeue its read as DEMAND if it has not started yet."""
        if load.priority is ReadPriority.DEMAND:
            return
        load.priority = ReadPriority.DEMAND
        if load.read is not None:
            load.resubmit = True
            if not load.read.cancel():  # already running: it finishes at its own pace
                load.resubmit = False

    async def _read(self, load: _Load, model: ServedModel, buffer) -> None:
        entry = model.pack.entry(load.key.layer, load.key.expert)
        while True:
            load.read = self.executor.submit(model.name, entry, buffer, load.priority)
            try:
                await asyncio.wrap_future(load.read)
                return
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if load.resubmit and not (current is not None and current.cancelling()):
                    load.resubmit = False
                    continue  # promoted: queue it again at DEMAND priority
                raise
            finally:
                load.read = None

    async def _run_load(self, load: _Load, step: ExpertStep, model: ServedModel, reuse: _Reuse | None,
                        demotion: asyncio.Future | None, handle: CopyHandle | None = None) -> None:
        """Read or wait for the source, copy it into the slot (unless `handle`: already issued),
        publish the slot once the copy completed."""
        key = step.key
        borrowed = None
        try:
            if handle is None:
                if step.source is Source.PACK:
                    borrowed = source = await self.staging.acquire()
                    await self._read(load, model, source)
                else:
                    assert self.host_tier is not None and step.host_slot is not None, step
                    if demotion is not None:  # its bytes are still on their way down
                        await asyncio.shield(demotion)
                    source = self.host_tier.slot(step.host_slot)
                if reuse is not None:
                    await self.fences.wait_quiesced(reuse.snapshot)  # no step may still read the victim
                    if reuse.demotion_issued is not None:  # its bytes are copied out first
                        await asyncio.shield(reuse.demotion_issued)
                handle = self._issue_copy(load, step, model, source)
            await handle.wait()
            self.arena.publish(self.slot_map.index(key), step.slot)
        except ObjectChecksumError as exc:
            self._fail(load, ObjectDataLoss(str(exc)))
        except asyncio.CancelledError:
            self._fail(load, ObjectReadFailed(f"load of {key} cancelled: storaged is stopping"))
            # A worker thread may still be writing into the buffer, or a device copy reading
            # from it: never hand it to another load. Loads are cancelled only at shutdown,
            # when the whole pool is freed anyway.
            borrowed = None
            raise
        except Exception as exc:  # noqa: BLE001 - any failed load must fail its waiters, not hang them
            self._fail(load, ObjectReadFailed(f"load of {key} failed: {exc}"))
        else:
            self.planner.complete(key)
            load.done.set_result(step.slot)
        finally:
            if borrowed is not None:
                self.staging.release(borrowed)
            if self._loads.get(key) is load:
                del self._loads[key]

    def _fail(self, load: _Load, error: LoadError) -> None:
        if self._loads.get(load.key) is load:
            del self._loads[load.key]
            self.planner.abort(load.key)
        for future in (load.issued, load.done):
            if not future.done():
                future.set_exception(error)

    # ---- shutdown ----------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Wait up to `timeout` s for loads in flight, then cancel what is left."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))

