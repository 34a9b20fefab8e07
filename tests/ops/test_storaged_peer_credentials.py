"""allowed_uids / allowed_gids: storaged admits or refuses each client by the credentials the
kernel recorded for its socket connection (SO_PEERCRED, SO_PEERGROUPS).

Clients run as real other users through `setpriv` (util-linux), so these tests need root. The
socket is opened to everyone (chmod 0666) so that the daemon's check, not the file mode,
decides who gets in.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import grpc
import pytest

from ops_testkit import require_binary
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
from storaged.client import StorageClient
from storaged.server.peer_access import AccessPolicy, PeerCredentials, PeerGate, peer_credentials
from storaged_testkit import PYTHON, REPO, SLOT_BYTES, Daemon, daemon_env, start_daemon, write_config

NOBODY = 65534
SOME_GROUP = 4242  # a group nobody is in unless setpriv puts them there
# One RPC of each kind; prints each status code name (OK for success).
CLIENT = r"""
import sys, grpc
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb, storage_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
codes = []
with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
    calls = (lambda: pb_grpc.ExpertStorageStub(channel).Info(pb.InfoRequest(), timeout=10),
             lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10),
             lambda: list(pb_grpc.ExpertStorageStub(channel).Acquire(iter(()), timeout=10)))
    for call in calls:
        try:
            call()
            codes.append("OK")
        except grpc.RpcError as error:
            codes.append(error.code().name)
print(" ".join(codes))
"""


def _as_user(*setpriv_args: str) -> list[str]:
    return [require_binary("setpriv"), *setpriv_args] if setpriv_args else []


def _client_codes(socket_path, *setpriv_args: str) -> list[str]:
    result = subprocess.run([*_as_user(*setpriv_args), PYTHON, "-c", CLIENT, str(socket_path)], cwd=REPO,
                            env=daemon_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.fixture(scope="module")
def as_root():
    if os.geteuid() != 0:
        pytest.skip("needs root: the daemon checks clients running as other users (setpriv)")
    probe = subprocess.run([*_as_user(f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"), PYTHON,
                            "-c", "import grpc, storaged"], cwd=REPO, env=daemon_env(), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot run this checkout's Python: {probe.stderr.strip()[-300:]}")


@pytest.mark.parametrize("uids, gids, peer, admitted", [
    ((0,), None, PeerCredentials(9, 0, 0, ()), True),
    ((1000,), None, PeerCredentials(9, 0, 0, ()), False),
    (None, (50,), PeerCredentials(9, 1000, 50, ()), True),  # primary group
    (None, (50,), PeerCredentials(9, 1000, 1000, (7, 50)), True),  # supplementary group
    (None, (50,), PeerCredentials(9, 50, 1000, ()), False),  # a uid is not a gid
    ((1000,), (50,), PeerCredentials(9, 1001, 51, (52,)), False),
])
def test_policy(tmp_path, uids, gids, peer, admitted):
    from storaged.config import StoragedConfig
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, allowed_uids=uids, allowed_gids=gids)
    assert AccessPolicy.from_config(config).admits(peer) is admitted


def test_no_lists_no_policy(tmp_path):
    from storaged.config import StoragedConfig
    assert AccessPolicy.from_config(StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1)) is None


def test_peer_credentials_come_from_the_kernel():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        peer = peer_credentials(left)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(peer.groups) == set(os.getgroups())


def test_uid_and_group_lists(as_root, disk_dir, bundle):
    """A daemon admitting uid 0 and group SOME_GROUP, against clients of several identities."""
    run = disk_dir / "gated"
    run.mkdir(mode=0o755)
    daemon = start_daemon(run, {"tiny": bundle.path}, allowed_uids=[0], allowed_gids=[SOME_GROUP])
    try:
        os.chmod(daemon.socket, 0o666)
        cases = {
            "root": ([], "OK"),
            "nobody in group 4242 (supplementary)": ([f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                                      f"--groups={SOME_GROUP}"], "OK"),
            "nobody with primary group 4242": ([f"--reuid={NOBODY}", f"--regid={SOME_GROUP}", "--clear-groups"], "OK"),
            "nobody, no groups": ([f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], "PERMISSION_DENIED"),
        }
        for name, (setpriv_args, expected) in cases.items():
            codes = _client_codes(daemon.socket, *setpriv_args)
            # The empty Acquire stream of an admitted client ends cleanly (OK); a refused one is refused.
            assert codes == [expected] * 3, (name, codes)
        # An admitted client gets the whole protocol through the gate: attach, map, acquire, bytes.
        with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
            (slot,) = session.acquire(2, [5])
            assert bytes(session.slot_bytes(slot, len(bundle.payloads[(2, 5)]))) == bundle.payloads[(2, 5)]
        private = [p for p in run.iterdir() if p.name.startswith(".storaged-")]
        assert len(private) == 1 and oct(private[0].stat().st_mode & 0o777) == oct(0o700)
    finally:
        exit_code = daemon.stop()
    stderr = daemon.stderr()
    assert exit_code == 0, stderr
    assert "refusing pid" in stderr and f"uid {NOBODY} gid {NOBODY} groups []" in stderr
    assert sorted(p.name for p in run.iterdir()) == ["storaged.toml"]  # socket and private dir gone


def test_root_refused_when_not_listed(as_root, disk_dir, bundle, tmp_path):
    """Root is no exception: a daemon admitting only uid 65534 refuses root's calls."""
    run = disk_dir / "nobody-only"
    run.mkdir(mode=0o755)
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify.sock"))
    receiver.settimeout(60)
    config = write_config(run / "storaged.toml", models={"tiny": bundle.path}, socket=str(run / "storaged.sock"),
                          vram_cache_bytes=4 * SLOT_BYTES, metrics_address="off", allowed_uids=[NOBODY])
    # Readiness comes from READY=1: our own health checks would be refused.
    daemon = Daemon(config, run / "storaged.sock", env=daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock")))
    try:
        assert b"READY=1" in receiver.recv(4096).split(b"\n")
        os.chmod(daemon.socket, 0o666)
        assert _client_codes(daemon.socket) == ["PERMISSION_DENIED"] * 3
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.ExpertStorageStub(channel).Attach(pb.AttachRequest(model="tiny"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "allowed_uids" in refused.value.details()
        assert _client_codes(daemon.socket, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups") == ["OK"] * 3
    finally:
        receiver.close()
        exit_code = daemon.stop()
    assert exit_code == 0, daemon.stderr()


# Three Attach calls on one connection; prints each status code name and the last refusal's message.
ATTACH_THRICE = r"""
import sys, grpc
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb, storage_pb2_grpc as pb_grpc
codes, details = [], ""
with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
    for _ in range(3):
        try:
            pb_grpc.ExpertStorageStub(channel).Attach(pb.AttachRequest(model="tiny"), timeout=10)
            codes.append("OK")
        except grpc.RpcError as error:
            codes.append(error.code().name)
            details = error.details()
print(" ".join(codes))
print(details)
"""


def test_sessions_are_bounded_per_uid(as_root, disk_dir, bundle):
    """max_sessions_per_peer counts each uid's sessions on its own, with no allow-list set."""
    run = disk_dir / "per-uid"
    run.mkdir(mode=0o755)
    daemon = start_daemon(run, {"tiny": bundle.path}, max_sessions_per_peer=2)
    try:
        os.chmod(daemon.socket, 0o666)
        outputs = {}
        for name, setpriv_args in (("root", []), ("nobody", [f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                                               "--clear-groups"])):
            result = subprocess.run([*_as_user(*setpriv_args), PYTHON, "-c", ATTACH_THRICE, str(daemon.socket)],
                                    cwd=REPO, env=daemon_env(), capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            outputs[name] = result.stdout.splitlines()
        # Each client exited without a stream: its sessions stay (until the idle time) and count.
        assert outputs["root"] == ["OK OK RESOURCE_EXHAUSTED", "peer uid 0 already holds 2 sessions, the most "
                                   "max_sessions_per_peer (2) allows; end unused sessions (Detach, or close their "
                                   "Acquire stream or data plane connection) or raise max_sessions_per_peer"]
        assert outputs["nobody"][0] == "OK OK RESOURCE_EXHAUSTED"
        assert f"peer uid {NOBODY} already holds 2 sessions" in outputs["nobody"][1]
        with StorageClient(str(daemon.socket)) as client:
            assert client.stats().sessions == 4
    finally:
        assert daemon.stop() == 0, daemon.stderr()


def test_gate_relays_large_transfers_and_half_close(tmp_path):
    """The splice itself, against a plain echo server on the admitted socket: 32 MiB each way
    (so back-pressure engages), then the client's half-close reaches the server and back."""
    payload = os.urandom(32 << 20)

    async def scenario() -> bytes:
        gate = PeerGate(tmp_path / "public.sock", AccessPolicy(frozenset({os.geteuid()}), frozenset()),
                        socket_mode=0o660)

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while chunk := await reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
            writer.close()  # after the client's EOF

        upstream = await asyncio.start_unix_server(echo, path=str(gate.admitted_path))
        await gate.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "public.sock"))

            async def send() -> None:
                for start in range(0, len(payload), 1 << 20):
                    writer.write(payload[start:start + (1 << 20)])
                    await writer.drain()
                writer.write_eof()

            sending = asyncio.create_task(send())
            received = await asyncio.wait_for(reader.read(-1), timeout=60)  # until the echo server closes
            await sending
            writer.close()
            return received
        finally:
            upstream.close()
            await gate.close()

    assert asyncio.run(scenario()) == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == ["public.sock"]  # private directory removed
