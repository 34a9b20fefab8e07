"""storaged SIGKILLed or SIGTERMed, during an Acquire stream and while idle: what the client sees,
and whether the next request after a restart on the same socket succeeds.

A client holds a session (on the data plane, or on a gRPC Acquire stream) when the daemon gets
the signal: "during a stream" a thread sends Acquires back to back, alternating cold and warm
experts, and the signal lands among them; "idle" the session is open with nothing in flight and
its next Acquire comes after the daemon is gone. The client must get a typed error with a status
code (never a hang, never a raw transport exception), the daemon must exit as its signal says
(0 after draining on SIGTERM), and once it is restarted a fresh client's first request must be
served byte-identical. What the old session and the old client's channel do afterwards is
recorded too: they are not reused by inference (it re-attaches), so only the fresh client is
asserted.
"""

from __future__ import annotations

import signal
import threading

import pytest

from reliability_kit import daemon_device, wait_for
from storaged.client import StorageClient, StorageError
from storaged_testkit import SLOT_BYTES, TEST_EXPERTS, start_daemon

TRANSPORTS = {"data plane": True, "gRPC stream": False}
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
EXIT_STATUS = {"SIGKILL": -signal.SIGKILL, "SIGTERM": 0}
# What a client sees when the daemon goes away under its session (asserted; docs/reliability.md).
EXPECTED_CODE = "UNAVAILABLE"


class Restarts:
    """One daemon at a time on one socket: each case kills the running one and starts the next."""

    def __init__(self, directory, bundle):
        self.directory = directory
        self.models = {"tiny": bundle.path}
        self.daemon = self.start()

    def start(self):
        return start_daemon(self.directory, self.models, vram_cache_bytes=6 * SLOT_BYTES, **daemon_device())

    def restart(self):
        self.daemon = self.start()
        return self.daemon


@pytest.fixture(scope="module")
def restarts(disk_dir, bundle):
    directory = disk_dir / "restarts"
    directory.mkdir()
    chain = Restarts(directory, bundle)
    yield chain
    chain.daemon.stop()


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "OK"
    if isinstance(exc, StorageError):
        return f"{type(exc).__name__} ({exc.code.name})"
    return f"untyped {type(exc).__name__}: {exc}"


def _busy(session, stop: threading.Event, seen: dict) -> None:
    """Acquires back to back until one fails (the failure is what the client saw)."""
    n = 0
    try:
        while not stop.is_set():
            layer = (1, 2, 4)[n % 3]
            session.acquire(layer, [n % TEST_EXPERTS, (n + 3) % TEST_EXPERTS])
            n += 1
            seen["acquires"] = n
    except BaseException as exc:  # noqa: BLE001 - recorded and asserted by the test
        seen["error"] = exc


# Two cases in the quick loop (a start costs seconds on a loaded 2-core machine), all eight when slow.
QUICK = {("SIGKILL", "during a stream", "data plane"), ("SIGTERM", "idle", "data plane")}
CASES = [pytest.param(signame, state, transport, id=f"{signame}-{state}-{transport}",
                      marks=() if (signame, state, transport) in QUICK else pytest.mark.slow)
         for signame in SIGNALS for state in ("during a stream", "idle") for transport in TRANSPORTS]


@pytest.mark.parametrize("signame, state, transport", CASES)
def test_daemon_killed_then_restarted(restarts, bundle, figures, signame, state, transport):
    daemon = restarts.daemon
    client = StorageClient(str(daemon.socket), timeout=10)
    session = client.attach("tiny", data_plane=TRANSPORTS[transport])
    session.acquire(1, [0, 1])
    seen: dict = {}
    if state == "during a stream":
        stop = threading.Event()
        thread = threading.Thread(target=_busy, args=(session, stop, seen), daemon=True)
        thread.start()
        wait_for(lambda: seen.get("acquires", 0) >= 20 or "error" in seen, what="acquires under way")
        daemon.process.send_signal(SIGNALS[signame])
        thread.join(30)
        stop.set()
        assert not thread.is_alive(), "the client hung after the daemon got " + signame
        error = seen.get("error")
    else:
        daemon.process.send_signal(SIGNALS[signame])
        daemon.process.wait(30)
        try:
            session.acquire(2, [0])
            error = None
        except BaseException as exc:  # noqa: BLE001
            error = exc
    status = daemon.process.wait(30)
    restarted = restarts.restart()
    try:
        session.acquire(2, [1])
        old_session = None
    except BaseException as exc:  # noqa: BLE001
        old_session = exc
    try:
        client.attach("tiny").close()
        old_client = None
    except BaseException as exc:  # noqa: BLE001
        old_client = exc
    session.close()
    client.close()
    with StorageClient(str(restarted.socket)) as fresh, fresh.attach("tiny", data_plane=TRANSPORTS[transport]) as s:
        slot, = s.acquire(4, [5])
        data = bundle.payloads[(4, 5)]
        fresh_ok = s.slot_bytes(slot, len(data)).cpu().numpy().tobytes() == data
    figures.record("daemon_restarts", **{f"{signame} {state} ({transport})": {
        "client_saw": _outcome(error), "message": str(error)[:160] if error else "", "exit_status": status,
        "old_session_after_restart": _outcome(old_session), "old_client_attach_after_restart": _outcome(old_client),
        "fresh_client_next_request": "OK, byte-identical" if fresh_ok else "wrong bytes"}})
    assert isinstance(error, StorageError) and error.code.name == EXPECTED_CODE, _outcome(error)
    assert status == EXIT_STATUS[signame], daemon.stderr()
    assert fresh_ok
