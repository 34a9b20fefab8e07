"""Start-up and shutdown of a real daemon: readiness, signals, socket handling, refusals.

Each start-up failure must exit non-zero with one clear line on stderr naming what is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from storaged.client import StorageClient, Unavailable
from storaged_testkit import (SLOT_BYTES, Daemon, daemon_env, run_daemon_expecting_failure, start_daemon,
                              write_bundle, write_config)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# abstract addresses with -m slow: tests/servicekit/test_notify.py sends to both kinds in process
@pytest.mark.parametrize("address_kind", ["path", pytest.param("abstract", marks=pytest.mark.slow)])
def test_ready_notification_then_sigterm_drains_and_exits_zero(tmp_path, bundle, address_kind):
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if address_kind == "path":
        address = str(tmp_path / "notify.sock")
        receiver.bind(address)
    else:
        name = f"expertpack-test-{os.getpid()}-{time.monotonic_ns()}"
        receiver.bind("\0" + name)
        address = "@" + name
    receiver.settimeout(30)
    daemon = start_daemon(tmp_path, {"tiny": bundle.path}, env=daemon_env(NOTIFY_SOCKET=address))
    try:
        assert b"READY=1" in receiver.recv(4096).split(b"\n")  # with a STATUS= line
        assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
        with StorageClient(str(daemon.socket)) as client:
            session = client.attach("tiny")
            session.acquire(1, [0])  # an open stream must not hold shutdown for the grace period
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGTERM)
            assert b"STOPPING=1" in receiver.recv(4096).split(b"\n")
            assert daemon.process.wait(20) == 0, daemon.stderr()
            assert time.monotonic() - started < 4.0  # below shutdown_grace_seconds (5)
            with pytest.raises(Unavailable):
                session.acquire(1, [1])
    finally:
        receiver.close()
        daemon.stop()
    assert not daemon.socket.exists()


@pytest.mark.slow  # a daemon start (~5 s); SIGINT takes SIGTERM's handler, whose drain the test above checks
def test_sigint_also_exits_zero(tmp_path, bundle):
    daemon = start_daemon(tmp_path, {"tiny": bundle.path})
    daemon.process.send_signal(signal.SIGINT)
    assert daemon.process.wait(20) == 0, daemon.stderr()
    assert not daemon.socket.exists()


def test_socket_mode_and_stale_socket_replaced(short_tmp_path, bundle):
    (short_tmp_path / "run").mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(short_tmp_path / "run" / "storaged.sock"))
    stale.close()  # bound but nobody listens: what a crashed daemon leaves behind
    daemon = start_daemon(short_tmp_path / "run", {"tiny": bundle.path})
    try:
        assert oct(os.stat(daemon.socket).st_mode & 0o777) == oct(0o660)
        # A second daemon on the same socket refuses to steal it from the live one.
        config = write_config(short_tmp_path / "second.toml", models={"tiny": bundle.path},
                              vram_cache_bytes=4 * SLOT_BYTES, socket=str(daemon.socket), metrics_address="off")
        result = run_daemon_expecting_failure(config)
        assert result.returncode == 1
        assert "already listening" in result.stderr
        assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert daemon.stop() == 0


def test_socket_directory_is_created_0750_whatever_the_umask(short_tmp_path, bundle):
    # the socket's group reaches the socket through the directories made for it; others do not
    previous = os.umask(0o002)  # inherited by the daemon: a lax umask must not widen them
    try:
        daemon = start_daemon(short_tmp_path, {"tiny": bundle.path}, socket_path=short_tmp_path / "a" / "b" / "s.sock")
    finally:
        os.umask(previous)
    assert daemon.socket.exists()
    made = (short_tmp_path / "a", short_tmp_path / "a" / "b")
    assert [oct(os.stat(d).st_mode & 0o777) for d in made] == [oct(0o750)] * 2
    assert daemon.stop() == 0


def _bundle_copy(tmp_path, bundle, name):
    target = tmp_path / name
    shutil.copytree(bundle.path, target)
    return target


def _missing(tmp_path, bundle):
    return tmp_path / "does-not-exist"


def _truncated_pack(tmp_path, bundle):
    target = _bundle_copy(tmp_path, bundle, "truncated")
    with open(target / "experts.pack", "r+b") as f:
        f.truncate(os.path.getsize(target / "experts.pack") - 4096)
    return target


def _bad_magic(tmp_path, bundle):
    target = _bundle_copy(tmp_path, bundle, "magic")
    with open(target / "experts.pack", "r+b") as f:
        f.write(b"NOTAPACK")
    return target


def _manifest_mismatch(tmp_path, bundle):
    target = _bundle_copy(tmp_path, bundle, "mismatch")
    other = tmp_path / "other"
    write_bundle(other, layers=(1, 2), experts=4, seed=1)  # another pack under this manifest
    shutil.copy(other / "experts.pack", target / "experts.pack")
    return target


def _no_pack(tmp_path, bundle):
    target = _bundle_copy(tmp_path, bundle, "nopack")
    (target / "experts.pack").unlink()
    return target


@pytest.mark.parametrize("make_bundle, needle", [
    (_missing, "not a bundle directory"),
    (_no_pack, "experts.pack: missing"),
    (_truncated_pack, "truncated"),
    (_bad_magic, "bad magic"),
    (_manifest_mismatch, "belongs to another pack"),
])
def test_bad_bundle_fails_start_with_clear_error(tmp_path, bundle, make_bundle, needle):
    path = make_bundle(tmp_path, bundle)
    config = write_config(tmp_path / "s.toml", models={"tiny": path}, vram_cache_bytes=4 * SLOT_BYTES,
                          socket=str(tmp_path / "s.sock"), metrics_address="off")
    result = run_daemon_expecting_failure(config)
    assert result.returncode == 1, result.stderr
    assert "storaged: error: model 'tiny'" in result.stderr and needle in result.stderr, result.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("fields, needle", [
    ({"vram_cache": "1GiB"}, "unknown key(s) vram_cache"),
    ({"vram_cache_bytes": "12 parsecs"}, "'vram_cache_bytes' = '12 parsecs'"),
    ({"device": "tpu:0"}, "'device' = 'tpu:0'"),
    ({"io_parallelism": 0}, "'io_parallelism' = 0"),
])
def test_bad_config_fails_start_with_clear_error(tmp_path, bundle, fields, needle):
    fields = {"vram_cache_bytes": 4 * SLOT_BYTES, **fields}
    config = write_config(tmp_path / "s.toml", models={"tiny": bundle.path},
                          socket=str(tmp_path / "s.sock"), **fields)
    result = run_daemon_expecting_failure(config)
    assert result.returncode == 2, result.stderr
    assert "storaged: configuration error" in result.stderr and needle in result.stderr, result.stderr


def test_a_model_named_twice_on_the_command_line_is_refused(tmp_path, bundle):
    config = write_config(tmp_path / "s.toml", models={"tiny": bundle.path}, vram_cache_bytes=4 * SLOT_BYTES,
                          socket=str(tmp_path / "s.sock"), metrics_address="off")
    result = run_daemon_expecting_failure(config, "--model", f"dup={bundle.path}", "--model", f"dup={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert "model 'dup' is given twice" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cache_smaller_than_one_slot_fails_start(tmp_path, bundle):
    config = write_config(tmp_path / "s.toml", models={"tiny": bundle.path}, vram_cache_bytes=4096,
                          socket=str(tmp_path / "s.sock"), metrics_address="off")
    result = run_daemon_expecting_failure(config)
    assert result.returncode == 1
    assert "holds no slot" in result.stderr


def test_cli_flags_override_the_file(tmp_path, bundle):
    config = write_config(tmp_path / "s.toml", models={"tiny": bundle.path}, vram_cache_bytes=4096,
                          socket=str(tmp_path / "unused.sock"), metrics_address="off")
    socket_path = tmp_path / "flag.sock"
    daemon = Daemon(config, socket_path, "--socket", str(socket_path), "--vram-cache-bytes", "48KiB")
    try:
        daemon.wait_serving()
        with StorageClient(str(socket_path)) as client:
            assert client.info().slot_count == 4
    finally:
        assert daemon.stop() == 0


def test_buffered_reads_from_tmpfs_with_host_tier_and_metrics(tmp_path_factory):
    """direct_io = false (buffered reads, e.g. a bundle on tmpfs), a host tier, /metrics on."""
    shm_root = tmp_path_factory.mktemp("shm-bundle")
    if os.path.isdir("/dev/shm"):
        shm_root = type(shm_root)(os.path.join("/dev/shm", f"storaged-test-{os.getpid()}"))
        shm_root.mkdir(exist_ok=True)
    try:
        payloads = write_bundle(shm_root / "bundle")
        port = _free_port()
        daemon = start_daemon(shm_root, {"tiny": shm_root / "bundle"}, direct_io=False,
                              vram_cache_bytes=3 * SLOT_BYTES, host_cache_bytes=8 * SLOT_BYTES,
                              metrics_address=f"127.0.0.1:{port}")
        try:
            with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
                info = client.info()
                assert "HOST_CACHE" in info.capabilities and "DIRECT_IO" not in info.capabilities
                for round_ in range(2):  # 2nd round: VRAM evicted them, the host tier has them
                    for expert in range(4):
                        slot = session.acquire(4, [expert])[0]
                        got = session.slot_bytes(slot, len(payloads[(4, expert)])).numpy().tobytes()
                        assert got == payloads[(4, expert)], (round_, expert)
                stats = client.stats()
                vram, host = stats.tiers["vram"], stats.tiers["host"]
                assert stats.reads == 4  # the second round came from VRAM or host RAM, not the pack
                assert host.hits >= 1 and vram.hits + host.hits == 4 and vram.evictions >= 2
                assert host.resident_experts == 4 and host.capacity_slots == 8
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                assert f'expertpack_storaged_hits_total{{tier="host"}} {float(host.hits)}' in body
                assert "expertpack_storaged_read_bytes_total" in body
        finally:
            assert daemon.stop() == 0, daemon.stderr()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


def test_info_reports_configured_models(tmp_path, bundle):
    second = tmp_path / "second"
    write_bundle(second, layers=(0, 1), experts=4, seed=3, model_type="mixtral")
    daemon = start_daemon(tmp_path, {"tiny": bundle.path, "mix": second})
    try:
        with StorageClient(str(daemon.socket)) as client:
            models = client.info().models
            assert list(models) == ["tiny", "mix"]
            assert models["mix"].model_type == "mixtral" and models["mix"].moe_layers == (0, 1)
            with client.attach("mix") as session:
                assert sorted(session.layers) == [0, 1]
                assert json.loads((second / "manifest.json").read_text())["experts"]["num_experts"] == 4
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("slots, starts", [(3, False), (8, True)])
def test_cache_smaller_than_a_tokens_top_k_fails_start_naming_the_slots_needed(tmp_path, slots, starts):
    """A model that routes each token to 8 experts a layer cannot decode with 3 slots: refused at
    start with the number needed, not with RESOURCE_EXHAUSTED on every request later."""
    path = tmp_path / "top8"
    write_bundle(path, top_k=8)
    config = write_config(tmp_path / "s.toml", models={"tiny": path}, vram_cache_bytes=slots * SLOT_BYTES,
                          socket=str(tmp_path / "s.sock"), metrics_address="off")
    if starts:
        daemon = Daemon(config, tmp_path / "s.sock")
        try:
            daemon.wait_serving()
        finally:
            assert daemon.stop() == 0
        return
    result = run_daemon_expecting_failure(config)
    assert result.returncode == 1
    assert "routes each token to 8 experts a layer, so at least 8 slots" in result.stderr, result.stderr
