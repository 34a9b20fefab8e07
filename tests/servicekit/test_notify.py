"""sd_notify without systemd: the datagram protocol and the addresses it accepts."""

from __future__ import annotations

import os
import socket

import pytest

from servicekit.notify import notify


def test_without_notify_socket_nothing_is_sent():
    assert notify("READY=1", environ={}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": ""}) is False


def test_path_and_abstract_addresses_receive_the_datagram(tmp_path):
    path = tmp_path / "notify.sock"
    abstract = f"expertpack-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as by_path, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as by_name:
        by_path.bind(str(path))
        by_name.bind("\0" + abstract)
        assert notify("READY=1", environ={"NOTIFY_SOCKET": str(path)}) is True
        assert notify("STOPPING=1", environ={"NOTIFY_SOCKET": "@" + abstract}) is True
        assert by_path.recv(64) == b"READY=1"
        assert by_name.recv(64) == b"STOPPING=1"


def test_relative_address_is_refused():
    with pytest.raises(ValueError, match="expected an absolute path"):
        notify("READY=1", environ={"NOTIFY_SOCKET": "run/notify"})
