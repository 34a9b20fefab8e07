"""sd_notify: tell systemd (Type=notify) a daemon's state over $NOTIFY_SOCKET.

The protocol is one datagram of newline-separated KEY=VALUE lines to the Unix socket named by
$NOTIFY_SOCKET; a name starting with '@' is in the abstract namespace (leading NUL byte).
Outside systemd the variable is unset and everything here does nothing.

    notifier = Notifier.from_environment()
    notifier.ready("serving qwen3 on /run/expertpack/storaged.sock")   # READY=1 + STATUS=...
    task = asyncio.create_task(notifier.watchdog_forever())            # WATCHDOG=1 pings
    task = asyncio.create_task(notifier.watchdog_forever(alive))       # ... only while alive() says so
    notifier.stopping("draining")                                      # STOPPING=1 + STATUS=...

The watchdog (WatchdogSec= in the unit) gives us $WATCHDOG_USEC; systemd restarts the service
when no WATCHDOG=1 arrives within it. We ping every half of it, as sd_watchdog_enabled(3)
recommends, from the event loop, so a wedged loop stops the pings and gets the daemon restarted;
a daemon whose real work happens elsewhere (inference's generation thread) passes `alive`, and a
ping is skipped whenever it answers False.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class NotifyEnvironmentError(ValueError):
    """$NOTIFY_SOCKET, $WATCHDOG_USEC or $WATCHDOG_PID holds something systemd never sets."""


def notify_address(environ: Mapping[str, str]) -> str | None:
    """The socket address from $NOTIFY_SOCKET (abstract names with their NUL), None when unset."""
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return None
    if address.startswith("@"):
        return "\0" + address[1:]  # abstract namespace: not a filesystem path
    if not address.startswith("/"):
        raise NotifyEnvironmentError(f"NOTIFY_SOCKET={address!r}: expected an absolute path or an '@' name")
    return address


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1") to $NOTIFY_SOCKET; False when no socket is configured."""
    address = notify_address(os.environ if environ is None else environ)
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC); None when the watchdog is off
    or $WATCHDOG_PID names another process (the variable leaked into a child)."""
    environ = os.environ if environ is None else environ
    usec_text = environ.get("WATCHDOG_USEC", "")
    if not usec_text:
        return None
    try:
        usec = int(usec_text)
    except ValueError:
        raise NotifyEnvironmentError(f"WATCHDOG_USEC={usec_text!r}: expected microseconds") from None
    if usec <= 0:
        return None  # systemd never sets this; sd_watchdog_enabled treats it as off
    pid_text = environ.get("WATCHDOG_PID", "")
    if pid_text:
        try:
            watchdog_pid = int(pid_text)
        except ValueError:
            raise NotifyEnvironmentError(f"WATCHDOG_PID={pid_text!r}: expected a process id") from None
        if watchdog_pid != (os.getpid() if pid is None else pid):
            return None
    return usec / 2 / 1e6


def _status_line(text: str) -> str:
    # One datagram line per key: a newline inside the text would start a bogus KEY=VALUE line.
    return "STATUS=" + " ".join(text.split())


class Notifier:
    """The daemon's side of the protocol. Sending never raises: a systemd that stopped listening
    must not take the daemon down with it, so failures are logged (once per kind of error)."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = dict(os.environ if environ is None else environ)
        self.address = notify_address(environ)
        self.watchdog_seconds = watchdog_interval(environ) if self.address else None
        self._socket: socket.socket | None = None
        self._logged_errors: set[type[OSError]] = set()
        self.last_status = ""

    @classmethod
    def from_environment(cls) -> Notifier:
        return cls(os.environ)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """One datagram of KEY=VALUE lines; False when disabled or the send failed."""
        if self.address is None:
            return False
        try:
            if self._socket is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)  # a full receive queue must not stall the event loop
                self._socket = sock
            self._socket.sendto("\n".join(lines).encode(), self.address)
        except OSError as exc:
            if type(exc) not in self._logged_errors:
                self._logged_errors.add(type(exc))
                log.warning("cannot notify systemd at %r: %s", self.address.replace("\0", "@"), exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        self.last_status = status
        return self.send("READY=1", _status_line(status))

    def status(self, status: str) -> bool:
        """Update the STATUS= line `systemctl status` shows; unchanged text is not resent."""
        if status == self.last_status:
            return False
        self.last_status = status
        return self.send(_status_line(status))

    def stopping(self, status: str) -> bool:
        self.last_status = status
        return self.send("STOPPING=1", _status_line(status))

    def ping_watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    async def watchdog_forever(self, alive: Callable[[], bool] | None = None) -> None:
        """Ping every watchdog_seconds until cancelled, skipping the pings for which `alive()` is
        false; returns at once when the watchdog is off."""
        if self.watchdog_seconds is None:
            return
        while True:
            if alive is None or alive():
                self.ping_watchdog()
            await asyncio.sleep(self.watchdog_seconds)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
