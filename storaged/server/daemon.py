"""The daemon's life: start-up in a fixed order, serve, and a draining shutdown on SIGTERM/SIGINT.

Start-up (storaged.cli validated the config and opened the bundles already): socket path
checked → arena, staging, host tier, reader → (CPU arena) the process made non-dumpable → the
data plane on `<socket>.data` → gRPC on the
Unix socket (directly, or behind the peer-credential gate when peers are identified: an
allow-list, or max_sessions_per_peer) → health SERVING → READY=1 to systemd, then WATCHDOG=1
pings when the unit sets WatchdogSec, and idle sessions are closed (sessions.py). Until the
socket listens, clients get UNAVAILABLE from their channel; while stopping, from the servicer. Shutdown: STOPPING=1,
health NOT_SERVING, refuse new work, end idle Acquire streams, let in-flight RPCs finish within
shutdown_grace_seconds, drain loads, free everything, remove the socket, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
from storaged.config import StoragedConfig
from storaged.server.models import ServedModel
from servicekit.notify import Notifier, NotifyEnvironmentError
from storaged.server.dataplane import DataPlaneServer
from storaged.server.malformed import MalformedRequestInterceptor
from storaged.server.peer_access import AccessPolicy, PeerGate, PrivateListenerError
from storaged.server.engine import StorageEngine
from storaged.server.runtime import Runtime, StartupError, build_runtime
from storaged.server.servicer import ExpertStorageServicer
from storaged.server.sessions import SessionRegistry
from storaged.server.stats import SYNC_INTERVAL_SECONDS, MetricsSync
from storaged.wire import dataplane as wire

EXIT_OK = 0
EXIT_STARTUP = 1
SOCKET_MODE = 0o660
SOCKET_DIR_MODE = 0o750  # a directory it creates for the socket: the socket's group may reach it, others not
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes including the terminating NUL
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertStorage"].full_name
STATUS_INTERVAL_SECONDS = 10.0  # how often `systemctl status` gets a fresh STATUS= line
IDLE_CHECK_SECONDS = 1.0  # idle sessions are looked for at least this often (more for short idle times)

log = logging.getLogger("storaged")


def prepare_socket_path(path: Path) -> None:
    """Create the parent directory (SOCKET_DIR_MODE); remove a stale socket; refuse if a daemon is
    listening there."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise StartupError(f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow "
                           f"{MAX_SOCKET_PATH}")
    try:
        _make_socket_directory(path.parent)
    except OSError as exc:
        raise StartupError(f"cannot create the socket directory {path.parent}: {exc.strerror}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # nobody listens: a socket left behind by a daemon that died
            return
    raise StartupError(f"another process is already listening on {path}")


def _make_socket_directory(directory: Path) -> None:
    """Create the missing directories down to `directory`, each SOCKET_DIR_MODE whatever the umask
    (an existing one is left as its owner made it)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, SOCKET_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs
        os.chmod(path, SOCKET_DIR_MODE)


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


async def _set_health(health: HealthServicer, status: int) -> None:
    for service in ("", SERVICE_NAME):
        await health.set(service, status)


def _serving_status(models: dict[str, ServedModel], config: StoragedConfig, runtime: Runtime,
                    sessions: int = 0, hits: int = 0, lookups: int = 0) -> str:
    hit_rate = f"{hits / lookups:.1%}" if lookups else "n/a"
    return (f"serving {', '.join(models)} on {config.socket}: {runtime.geometry.slot_count} slots of "
            f"{runtime.geometry.slot_bytes} B on {config.device}; sessions {sessions}; vram hit rate {hit_rate}")


async def _sync_metrics_forever(sync: MetricsSync, notifier: Notifier, status) -> None:
    next_status = asyncio.get_running_loop().time() + STATUS_INTERVAL_SECONDS
    while True:
        await asyncio.sleep(SYNC_INTERVAL_SECONDS)
        stats = sync.sync()
        if notifier.enabled and asyncio.get_running_loop().time() >= next_status:
            next_status += STATUS_INTERVAL_SECONDS
            notifier.status(status(len(sync.sessions), stats.vram_hits, stats.vram_hits + stats.vram_misses))


def _listen(server: grpc.aio.Server, config: StoragedConfig) -> PeerGate | None:
    """Bind gRPC to the public socket, or to the gate's private listener when peers are identified."""
    try:
        gate = (PeerGate(config.socket, AccessPolicy.from_config(config), socket_mode=SOCKET_MODE)
                if config.identifies_peers else None)
    except PrivateListenerError as exc:
        raise StartupError(str(exc)) from None
    try:
        server.add_insecure_port(gate.admitted_address if gate else f"unix:{config.socket}")
    except RuntimeError as exc:
        if gate is not None:
            gate.remove_private_dir()
        raise StartupError(f"cannot listen on {config.socket}: {exc}") from None
    return gate


def _gate_description(gate: PeerGate | None) -> str:
    if gate is None:
        return ""
    return f"; admitting peers by {gate.policy}" if gate.policy is not None else "; identifying peers by uid"


async def _close_idle_sessions_forever(sessions: SessionRegistry, engine: StorageEngine) -> None:
    """Ends sessions left without a stream or data plane connection for session_idle_seconds."""
    interval = min(IDLE_CHECK_SECONDS, max(sessions.idle_seconds / 4, 0.02))
    loop = asyncio.get_running_loop()
    unlogged, log_after = 0, loop.time()
    while True:
        await asyncio.sleep(interval)
        closed = sessions.close_idle()
        for session in closed:
            engine.close_session(session)  # as when a stream ends: its pins, if any, are released
        engine.metrics.add("sessions_idle_closed_total", len(closed))
        unlogged += len(closed)
        if unlogged and loop.time() >= log_after:  # one line per STATUS_INTERVAL_SECONDS at most
            log.info("closed %d session(s) idle for %g s without an Acquire stream or data plane connection",
                     unlogged, sessions.idle_seconds)
            unlogged, log_after = 0, loop.time() + STATUS_INTERVAL_SECONDS


async def _preload(engine: StorageEngine, models: dict[str, ServedModel]) -> None:
    started = time.perf_counter()
    log.info("preload: reading experts of %s into the tiers while serving", ", ".join(models))
    try:
        report = await engine.preload(list(models.values()))
    except asyncio.CancelledError:
        log.info("preload: stopped with the daemon after starting %d loads",
                 engine.metrics.snapshot().values["preload_loads_total"])
        raise
    except Exception:  # a background task's error would otherwise go unseen; requests are unaffected
        log.exception("preload: stopped by an error")
        return
    ended = {"full": "the tiers are full", "busy": "stopped: requests held every VRAM slot",
             "": "every expert is cached"}[report.stopped]
    log.info("preload: %d experts read in %.1f s%s; %s", report.loaded, time.perf_counter() - started,
             f", {report.failed} failed (their read errors are logged)" if report.failed else "", ended)


async def _serve(config: StoragedConfig, models: dict[str, ServedModel], runtime: Runtime,
                 stop: asyncio.Event, notifier: Notifier) -> int:
    sessions = SessionRegistry(idle_seconds=config.session_idle_seconds,
                               max_per_owner=config.max_sessions_per_peer or None)
    sync = MetricsSync(runtime.engine, sessions)
    data_plane = DataPlaneServer(Path(wire.socket_path_for(str(config.socket))), runtime.engine, sessions,
                                 runtime.fences, AccessPolicy.from_config(config))
    health = HealthServicer()
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    gate = _listen(server, config)
    background: list[asyncio.Task] = []
    data_plane_started = False
    try:
        servicer = ExpertStorageServicer(config, models, runtime, sessions, sync, peers=gate)
        pb_grpc.add_ExpertStorageServicer_to_server(servicer, server)
        prepare_socket_path(data_plane.path)
        try:
            await data_plane.start()
        except OSError as exc:
            raise StartupError(f"cannot listen on {data_plane.path}: {exc.strerror or exc}") from None
        data_plane_started = True
        await server.start()
        if gate is None:
            os.chmod(config.socket, SOCKET_MODE)
        else:
            try:
                await gate.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on {config.socket}: {exc.strerror or exc}") from None
        status = functools.partial(_serving_status, models, config, runtime)
        await _set_health(health, health_pb2.HealthCheckResponse.SERVING)
        notifier.ready(status())
        background.append(asyncio.create_task(_sync_metrics_forever(sync, notifier, status), name="metrics sync"))
        background.append(asyncio.create_task(notifier.watchdog_forever(), name="watchdog"))
        background.append(asyncio.create_task(_close_idle_sessions_forever(sessions, runtime.engine),
                                              name="idle sessions"))
        log.info("%s%s", status(), _gate_description(gate))
        preload = asyncio.create_task(_preload(runtime.engine, models), name="preload") if config.preload else None
        if preload is not None:
            background.append(preload)
        await stop.wait()
        if preload is not None:  # before the drain: it would start loads the drain does not wait for
            preload.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await preload
        log.info("stopping: draining for up to %.1f s", config.shutdown_grace_seconds)
        notifier.stopping(f"draining for up to {config.shutdown_grace_seconds:g} s")
        if gate is not None:
            gate.stop_accepting()
        await health.enter_graceful_shutdown()
        servicer.begin_shutdown()
        data_plane.begin_shutdown()
        await server.stop(config.shutdown_grace_seconds)
        await runtime.engine.drain(config.shutdown_grace_seconds)
    finally:
        for task in background:
            task.cancel()
        if gate is not None:
            await gate.close()
        if data_plane_started:
            await data_plane.close()
        _remove_socket(config.socket)
    return EXIT_OK


async def serve(config: StoragedConfig, models: dict[str, ServedModel]) -> int:
    """Run the daemon on opened models until SIGTERM or SIGINT; the exit status. Closes the models."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        notifier = Notifier.from_environment()
        prepare_socket_path(config.socket)  # before allocating: a live daemon there is a quick no
        runtime = build_runtime(config, models)
    except NotifyEnvironmentError as exc:
        _close_models(models)
        return _fail(f"{exc} (set by the service manager)")
    except StartupError as exc:
        _close_models(models)
        return _fail(str(exc))
    try:
        if runtime.arena.client_fd is not None:
            forbid_same_user_access()
        return await _serve(config, models, runtime, stop, notifier)
    except StartupError as exc:
        return _fail(str(exc))
    finally:
        notifier.close()
        runtime.close()
        _close_models(models)


PR_SET_DUMPABLE = 4  # prctl(2) option


def forbid_same_user_access() -> None:
    """Mark this process non-dumpable, so that a process of the daemon's own uid (a client started
    as the same user) cannot ptrace it, write its memory through /proc/<pid>/mem or open its
    descriptors through /proc/<pid>/fd: the daemon's mapping is the one writable view of a memfd
    arena. Root keeps those powers; no core dumps either (they would hold the whole cache)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise StartupError(f"cannot make the daemon non-dumpable (prctl PR_SET_DUMPABLE): "
                           f"{os.strerror(ctypes.get_errno())}; a process of its uid could write the arena")


def _close_models(models: dict[str, ServedModel]) -> None:
    for model in models.values():
        model.close()


def _fail(message: str) -> int:
    print(f"storaged: error: {message}", file=sys.stderr, flush=True)
    return EXIT_STARTUP


def run(config: StoragedConfig, models: dict[str, ServedModel]) -> int:
    """Serve the opened bundles (see storaged.cli, which opens them first); the exit status."""
    import uvloop

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s storaged %(levelname)s %(message)s")
    return uvloop.run(serve(config, models))
