"""The tamper test: no other process can change what any session reads from a CPU arena.

A real daemon serves; a victim session caches some objects. An attacker, a separate process that
is itself a client and runs as the daemon's own uid (the strongest case short of root: both run
as `nobody` through setpriv when the tests run as root), receives the arena's descriptor over
the data plane like any client and tries every way to write through it, through /proc/self/fd,
and through the daemon's /proc/<pid>/fd and /proc/<pid>/mem. The kernel must refuse every
attempt, and afterwards the cached objects are served byte-identical to the pack, as hits, to
the victim's views and to a new session. A peer the allow-list refuses gets no descriptor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from arena_attacks import raw_arena_exchange
from storaged_testkit import PYTHON, REPO, SLOT_BYTES, Daemon, daemon_env, disk_tmp_root, start_daemon, write_bundle, \
    write_config

from storaged.client import StorageClient
from storaged.wire import dataplane as wire

NOBODY = 65534
SOME_GROUP = 4242  # the sockets' group in the refused-peer case: the attacker is in it, unlisted
CACHED = {1: [0, 1, 2], 4: [5]}  # layer -> experts the victim caches
TESTS = Path(__file__).resolve().parent

# A client of the daemon (it reads an expert like anyone), then an attacker of the arena's fd.
ATTACKER = r"""
import json, os, sys
from arena_attacks import attacks
from storaged.client import StorageClient
from storaged.client.dataplane import receive_arena_fd
from storaged.wire import dataplane as wire
socket_path, pid = sys.argv[1], int(sys.argv[2]) if sys.argv[2] != "-" else None
with StorageClient(socket_path) as client, client.attach("tiny") as session:
    session.acquire(2, [3])
    fd = receive_arena_fd(wire.socket_path_for(socket_path), session.id)
    print(json.dumps(attacks(fd, os.fstat(fd).st_size, pid)))
"""

# A peer the allow-list refuses, that even knows a live session's id.
REFUSED = r"""
import glob, json, sys
import grpc
from arena_attacks import daemon_attacks, raw_arena_exchange
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb, storage_pb2_grpc as pb_grpc
from storaged.wire import dataplane as wire
socket_path, session_id, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
with grpc.insecure_channel("unix:" + socket_path) as channel:
    try:
        pb_grpc.ExpertStorageStub(channel).Attach(pb.AttachRequest(model="tiny"), timeout=10)
        out["Attach"] = "OK"
    except grpc.RpcError as error:
        out["Attach"] = error.code().name
out["ARENA"] = raw_arena_exchange(wire.socket_path_for(socket_path), session_id)
for name, attack in daemon_attacks(pid).items():
    try:
        attack()
        out[name] = "WROTE"
    except OSError as error:
        out[name] = "refused"
# this daemon's files only (a named arena was expertpack-arena-<pid>-*): other daemons may run
out["arena files"] = glob.glob(f"/dev/shm/expertpack-arena-{pid}-*") + glob.glob(f"/tmp/expertpack-arena-{pid}-*")
print(json.dumps(out))
"""


def _unprivileged(*groups: int) -> tuple[str, ...] | None:
    """A setpriv prefix that runs a process as `nobody` (in `groups`), or None when the tests
    cannot (not root, no setpriv, or nobody cannot run this checkout's Python)."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    prefix = (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}",
              f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups")
    probe = subprocess.run([*prefix, PYTHON, "-c", "import grpc, storaged"], cwd=REPO, env=daemon_env(),
                           capture_output=True, text=True)
    return prefix if probe.returncode == 0 else None


def _run(prefix: tuple[str, ...], script: str, *args: str) -> dict:
    env = daemon_env(PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([*prefix, PYTHON, "-c", script, *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def shared_dir():
    """A directory other users can reach: the daemon and the attacker may run as nobody."""
    path = Path(tempfile.mkdtemp(prefix="storaged-tamper-", dir=disk_tmp_root()))
    path.chmod(0o755)
    payloads = write_bundle(path / "bundle")
    yield path, payloads
    shutil.rmtree(path, ignore_errors=True)


def _cache(client: StorageClient, payloads):
    """A victim session holding CACHED, checked against the pack; (session, {(layer, expert): view})."""
    session = client.attach("tiny")
    views = {}
    for layer, experts in CACHED.items():
        for expert, slot in zip(experts, session.acquire(layer, experts), strict=True):
            views[(layer, expert)] = session.slot_bytes(slot, len(payloads[(layer, expert)]))
    assert {key: view.numpy().tobytes() for key, view in views.items()} == {key: payloads[key] for key in views}
    return session, views


def _still_served_identical(client: StorageClient, views, payloads) -> None:
    """The victim's views and a new session's hits are the pack's bytes; nothing was re-read."""
    for key, view in views.items():
        assert view.numpy().tobytes() == payloads[key], f"the victim's view of {key} changed"
    before = client.stats()
    with client.attach("tiny") as fresh:
        for layer, experts in CACHED.items():
            for expert, slot in zip(experts, fresh.acquire(layer, experts), strict=True):
                assert fresh.slot_bytes(slot, len(payloads[(layer, expert)])).numpy().tobytes() == \
                    payloads[(layer, expert)], f"a new session was served altered bytes of {(layer, expert)}"
    after = client.stats()
    assert after.bytes_read == before.bytes_read  # served from the cache: hits, not reloads
    assert after.tiers["vram"].hits - before.tiers["vram"].hits == sum(map(len, CACHED.values()))


def test_a_client_of_the_daemons_uid_cannot_change_what_any_session_reads(shared_dir):
    directory, payloads = shared_dir
    prefix = _unprivileged()
    run = directory / "same-uid"
    run.mkdir(mode=0o755)
    if prefix is not None:
        os.chown(run, NOBODY, NOBODY)  # the daemon, as nobody, makes its sockets here
    daemon = start_daemon(run, {"tiny": directory / "bundle"}, prefix=prefix or (),
                          vram_cache_bytes=10 * SLOT_BYTES)
    try:
        with StorageClient(str(daemon.socket)) as client:
            victim, views = _cache(client, payloads)
            # Root may write any process's memory: the daemon's own attacks need an unprivileged attacker.
            pid = str(daemon.process.pid) if prefix is not None or os.geteuid() != 0 else "-"
            outcomes = _run(prefix or (), ATTACKER, str(daemon.socket), pid)
            assert len(outcomes) == (10 if pid != "-" else 8), outcomes
            assert [name for name, o in outcomes.items() if not o.startswith("refused")] == [], outcomes
            _still_served_identical(client, views, payloads)
            victim.close()
    finally:
        assert daemon.stop() == 0, daemon.stderr()


def test_a_peer_refused_by_the_allow_list_gets_no_descriptor(shared_dir):
    """Refused here means refused before anything is read: not even a live session's id helps."""
    directory, _ = shared_dir
    run = directory / "refused-self"
    run.mkdir()
    config = write_config(run / "storaged.toml", models={"tiny": directory / "bundle"}, socket=str(run / "s.sock"),
                          vram_cache_bytes=4 * SLOT_BYTES, metrics_address="off",
                          allowed_uids=[os.getuid() + 12345])
    daemon = Daemon(config, run / "s.sock")  # its health check would refuse us too: wait for the data plane
    try:
        data_socket = Path(wire.socket_path_for(str(daemon.socket)))
        for _ in range(600):
            if data_socket.exists() or daemon.process.poll() is not None:
                break
            time.sleep(0.05)
        reply = raw_arena_exchange(str(data_socket), "any-session")
        assert reply == {"kind": wire.Kind.ERROR, "code": grpc.StatusCode.PERMISSION_DENIED.value[0],
                         "descriptors": 0}
    finally:
        daemon.stop()


def test_a_refused_process_of_the_sockets_group_cannot_reach_the_arena(shared_dir):
    """The issue's case: a process that may connect (it has the sockets' group) but is not listed."""
    prefix = _unprivileged(SOME_GROUP)
    if prefix is None:
        pytest.skip("needs root and setpriv: the refused peer runs as another user")
    directory, payloads = shared_dir
    run = directory / "refused-group"
    run.mkdir(mode=0o755)
    daemon = start_daemon(run, {"tiny": directory / "bundle"}, allowed_uids=[os.geteuid()],
                          vram_cache_bytes=10 * SLOT_BYTES)
    try:
        for path in (daemon.socket, Path(wire.socket_path_for(str(daemon.socket)))):
            os.chown(path, -1, SOME_GROUP)  # mode 0660: the group may connect
        with StorageClient(str(daemon.socket)) as client:
            victim, views = _cache(client, payloads)
            outcomes = _run(prefix, REFUSED, str(daemon.socket), victim.id, str(daemon.process.pid))
            assert outcomes["Attach"] == "PERMISSION_DENIED"
            assert outcomes["ARENA"] == {"kind": wire.Kind.ERROR, "descriptors": 0,
                                         "code": grpc.StatusCode.PERMISSION_DENIED.value[0]}
            assert outcomes["reopen /proc/<daemon>/fd/N read-write, write"] == "refused"
            assert outcomes["write /proc/<daemon>/mem at the arena"] == "refused"
            assert outcomes["arena files"] == []
            _still_served_identical(client, views, payloads)
            victim.close()
    finally:
        assert daemon.stop() == 0, daemon.stderr()
