"""What systemd does with $NOTIFY_SOCKET, for tests of the daemons that speak the notify protocol."""

from __future__ import annotations

import socket
import time


class NotifyReceiver:
    """A bound datagram socket, read one message (a dict of KEY=VALUE lines) at a time."""

    def __init__(self, path):
        self.path = str(path)
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.path)

    def next(self, timeout: float = 30) -> dict[str, str]:
        self.socket.settimeout(timeout)
        lines = self.socket.recv(4096).decode().split("\n")
        return dict(line.split("=", 1) for line in lines)

    def collect(self, seconds: float) -> list[dict[str, str]]:
        messages, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                messages.append(self.next(timeout=left))
            except TimeoutError:
                break
        return messages

    def drain(self) -> list[dict[str, str]]:
        """The messages already waiting, without waiting for more."""
        messages = []
        self.socket.setblocking(False)
        try:
            while True:
                lines = self.socket.recv(4096).decode().split("\n")
                messages.append(dict(line.split("=", 1) for line in lines))
        except BlockingIOError:
            return messages
        finally:
            self.socket.setblocking(True)

    def close(self) -> None:
        self.socket.close()
