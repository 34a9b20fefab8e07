"""storaged speaks systemd's notify protocol to a real datagram socket standing in for
$NOTIFY_SOCKET: READY=1 and STATUS= once serving, WATCHDOG=1 every WATCHDOG_USEC/2 when the
watchdog is meant for this process, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from notify_testkit import NotifyReceiver

from servicekit.notify import Notifier, NotifyEnvironmentError, watchdog_interval
from storaged_testkit import PYTHON, REPO, SLOT_BYTES, Daemon, daemon_env, write_config

WATCHDOG_USEC = 300_000  # pings every 0.15 s
LISTEN_SECONDS = 1.0


@pytest.mark.parametrize("environ, pid, expected", [
    ({}, 100, None),
    ({"WATCHDOG_USEC": "30000000"}, 100, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "100"}, 100, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "101"}, 100, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, 100, None),
    ({"WATCHDOG_USEC": ""}, 100, None),
])
def test_watchdog_interval(environ, pid, expected):
    assert watchdog_interval(environ, pid=pid) == expected


@pytest.mark.parametrize("environ", [{"WATCHDOG_USEC": "soon"}, {"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}])
def test_malformed_watchdog_variables_raise(environ):
    with pytest.raises(NotifyEnvironmentError, match="WATCHDOG_"):
        watchdog_interval(environ, pid=1)


def test_notifier_sends_status_once_per_change_on_one_line(tmp_path):
    receiver = NotifyReceiver(tmp_path / "notify.sock")
    notifier = Notifier({"NOTIFY_SOCKET": receiver.path})
    try:
        assert notifier.ready("serving\nm1")
        assert receiver.next() == {"READY": "1", "STATUS": "serving m1"}
        assert notifier.status("busy") and not notifier.status("busy")
        assert notifier.ping_watchdog()
        assert [m for m in receiver.collect(0.3)] == [{"STATUS": "busy"}, {"WATCHDOG": "1"}]
    finally:
        notifier.close()
        receiver.close()


def test_notifier_survives_a_vanished_systemd(tmp_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert notifier.enabled
    assert notifier.ready("serving") is False  # logged, not raised
    assert Notifier({}).ready("serving") is False and not Notifier({}).enabled


class DaemonWithWatchdogPid(Daemon):
    """As systemd starts a service: WATCHDOG_PID is the pid its main process will have. The
    shell exports its own pid, then exec()s the daemon into that same process."""

    def __init__(self, config, socket_path, env):
        self.socket = socket_path
        self.process = subprocess.Popen(
            ["sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh", PYTHON, "-m", "storaged", "--config", str(config)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start(tmp_path, bundle, env: dict[str, str], *, exec_pid_as_watchdog_pid: bool = False) -> Daemon:
    socket_path = tmp_path / "storaged.sock"
    config = write_config(tmp_path / "storaged.toml", models={"tiny": bundle.path}, socket=str(socket_path),
                          vram_cache_bytes=4 * SLOT_BYTES, metrics_address="off")
    kind = DaemonWithWatchdogPid if exec_pid_as_watchdog_pid else Daemon
    return kind(config, socket_path, env=daemon_env(**env))


# The daemon's own WATCHDOG_PID (systemd's case) in the fast loop; the other two, a daemon start each,
# with -m slow: tests/servicekit/test_notify.py's test_watchdog_interval reads every variant in process.
@pytest.mark.parametrize("case, env, exec_pid, pings", [
    pytest.param("watchdog, no WATCHDOG_PID", {"WATCHDOG_USEC": str(WATCHDOG_USEC)}, False, True,
                 marks=pytest.mark.slow),
    ("watchdog, WATCHDOG_PID is the daemon", {"WATCHDOG_USEC": str(WATCHDOG_USEC)}, True, True),
    pytest.param("watchdog for another process", {"WATCHDOG_USEC": str(WATCHDOG_USEC), "WATCHDOG_PID": "1"}, False,
                 False, marks=pytest.mark.slow),
    # without WATCHDOG_USEC: tests/storaged/test_server_lifecycle.py sees STOPPING=1 right after READY=1
])
def test_daemon_ready_watchdog_stopping(tmp_path, bundle, case, env, exec_pid, pings):
    receiver = NotifyReceiver(tmp_path / "notify.sock")
    daemon = _start(tmp_path, bundle, {"NOTIFY_SOCKET": receiver.path, **env}, exec_pid_as_watchdog_pid=exec_pid)
    try:
        ready = receiver.next()
        assert ready["READY"] == "1"
        assert ready["STATUS"].startswith(f"serving tiny on {daemon.socket}: 4 slots")
        messages = receiver.collect(LISTEN_SECONDS)
        watchdog = [m for m in messages if m == {"WATCHDOG": "1"}]
        if pings:
            expected = LISTEN_SECONDS / (WATCHDOG_USEC / 2 / 1e6)  # about 7
            assert 0.5 * expected <= len(watchdog) <= 1.5 * expected, messages
        else:
            assert watchdog == [], messages
        daemon.process.send_signal(signal.SIGTERM)
        stopping = next(m for m in iter(receiver.next, None) if "WATCHDOG" not in m)
        assert stopping["STOPPING"] == "1" and stopping["STATUS"].startswith("draining")
        assert daemon.process.wait(20) == 0, daemon.stderr()
    finally:
        receiver.close()
        daemon.stop()


@pytest.mark.parametrize("env, message", [
    ({"NOTIFY_SOCKET": "run/notify.sock"}, "NOTIFY_SOCKET='run/notify.sock': expected an absolute path"),
    ({"NOTIFY_SOCKET": "@expertpack-test", "WATCHDOG_USEC": "soon"}, "WATCHDOG_USEC='soon'"),
])
def test_daemon_refuses_a_garbled_service_environment(tmp_path, bundle, env, message):
    daemon = _start(tmp_path, bundle, env)
    try:
        assert daemon.process.wait(60) == 1
        assert message in daemon.stderr()
    finally:
        daemon.stop()
    assert not os.path.exists(tmp_path / "storaged.sock")
