"""sd_notify: tell systemd (Type=notify) the daemon's state over $NOTIFY_SOCKET.

The protocol is one datagram of newline-separated KEY=VALUE lines to the Unix socket named by
$NOTIFY_SOCKET; a name starting with '@' is in the abstract namespace (leading NUL byte).
Outside systemd the variable is unset and notify() does nothing.
"""

from __future__ import annotations

import os
import socket


def notify(state: str, *, environ: dict[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1") to $NOTIFY_SOCKET; False when no socket is configured."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace: not a filesystem path
    elif not address.startswith("/"):
        raise ValueError(f"NOTIFY_SOCKET={address!r}: expected an absolute path or an '@' name")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True
