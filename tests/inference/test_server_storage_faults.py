"""What an HTTP client of `inference serve` sees when the expert storage fails a request without
being down: an object that fails its checksum (storaged's DATA_LOSS, or the local pack's own
check) is a 502 `expert_data_loss`, a cache whose slots other clients pin is a 503
`expert_capacity_exhausted`; each is counted, `/health` stays 200, the server's log names the
object (without a traceback), and no path of the server's files reaches the client.

Real components throughout: a storaged daemon on a copy of a bundle, `inference serve` as a
subprocess, another storaged client holding pins, bytes flipped in the pack file.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
from test_engine_fixtures import tiny_bundle
from test_server_fixtures import ServerProcess, get, metric, post, request_with_headers, serving
from test_storaged_source_fixtures import (
    StoragedDaemon,
    cases_dir,  # noqa: F401  (the fixture)
    qwen_case,  # noqa: F401  (the fixture)
)

from inference.server.errors import HIDDEN_PATH, public
from packformat import PackReader
from packformat.bundle import open_bundle
from storaged.client import StorageClient

MODEL = "faulty-moe"
CACHE_SLOTS = 2  # the model's top-k: the least storaged accepts, and all of it pinnable by one client
DATA_LOSS_TOTAL = "expertpack_inference_expert_data_loss_total"
CAPACITY_TOTAL = "expertpack_inference_expert_capacity_exhausted_total"


def chat_request() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Are the experts intact?"}],
            "max_tokens": 2, "temperature": 0}


@contextlib.contextmanager
def corrupted(pack: Path):
    """Every object of `pack` with one payload byte flipped (its index crc32 no longer matches);
    the bytes are put back on exit."""
    with PackReader(pack) as reader:
        offsets = [entry.offset for entry in reader.objects]
    with open(pack, "r+b") as f:
        saved = []
        for offset in offsets:
            f.seek(offset + 7)
            saved.append(f.read(1))
            f.seek(offset + 7)
            f.write(bytes([saved[-1][0] ^ 0xFF]))
    try:
        yield len(offsets)
    finally:
        with open(pack, "r+b") as f:
            for offset, byte in zip(offsets, saved, strict=True):
                f.seek(offset + 7)
                f.write(byte)


def server_paths(*paths: Path) -> list[str]:
    """Paths (and their parent directories) that must not appear in anything a client reads."""
    return sorted({str(p) for path in paths for p in (path, path.parent)} - {"/", "/tmp"})


def assert_no_path(body, paths: list[str]) -> None:
    text = str(body)
    assert not [p for p in paths if p in text], text


def new_log(server: ServerProcess, seen: int) -> str:
    return "".join(server.lines[seen:])


@pytest.fixture(scope="module")
def storaged_bundle(qwen_case, tmp_path_factory) -> Path:
    """A copy of the qwen bundle this module may damage (and repair)."""
    bundle = tmp_path_factory.mktemp("faulty") / "bundle-with-a-recognizable-path"
    shutil.copytree(qwen_case.bundle, bundle)
    return bundle


@pytest.fixture
def daemon(storaged_bundle):
    """A daemon of its own for each test: a server holds its last layer's pins between requests,
    so a test that pins the cache from another client must come before the server's first request."""
    with open_bundle(storaged_bundle) as bundle:
        slot = bundle.pack.max_object_size
        assert bundle.experts["top_k"] == CACHE_SLOTS and bundle.experts["moe_layers"] == [0, 1]
    daemon = StoragedDaemon({MODEL: storaged_bundle}, vram_cache_bytes=CACHE_SLOTS * slot)
    yield daemon
    daemon.stop()


@pytest.fixture
def server(storaged_bundle, daemon):
    with serving(storaged_bundle, model_name=MODEL,
                 source=("--storaged", str(daemon.socket), "--storaged-model", MODEL)) as process:
        yield process


def test_a_corrupt_object_in_storaged_is_a_502_expert_data_loss(storaged_bundle, daemon, server):
    before = metric(get(server.base_url + "/metrics")[1], DATA_LOSS_TOTAL)
    seen = len(server.lines)
    with corrupted(storaged_bundle / "experts.pack"):
        # two slots, two MoE layers: whatever the cache holds, this request reads objects from the pack
        status, body = post(server.base_url + "/v1/chat/completions", chat_request())
        assert status == 502, body
        error = body["error"]
        assert (error["type"], error["code"], error["param"]) == ("server_error", "expert_data_loss", None), error
        assert "integrity check" in error["message"]
        assert_no_path(body, server_paths(storaged_bundle / "experts.pack", daemon.socket))
        assert get(server.base_url + "/health")[0] == 200, "one damaged object does not make the server unhealthy"
    assert metric(get(server.base_url + "/metrics")[1], DATA_LOSS_TOTAL) == before + 1
    log = new_log(server, seen)
    assert "expert data loss" in log and "DATA_LOSS" in log, log  # the operator learns which object
    assert "Traceback" not in log, log
    status, body = post(server.base_url + "/v1/chat/completions", chat_request())
    assert status == 200, body  # the bundle repaired, the same server serves again
    assert daemon.stats().checksum_failures >= 1


@pytest.mark.slow  # a second daemon client pins the cache while a server decodes: ~15 s; the corrupt-object case keeps serve through storaged in the fast loop
def test_a_cache_pinned_by_another_client_is_a_503_expert_capacity_exhausted(daemon, server):
    before = metric(get(server.base_url + "/metrics")[1], CAPACITY_TOTAL)
    seen = len(server.lines)
    with StorageClient(str(daemon.socket)) as client, client.attach(MODEL) as other:
        # every slot pinned on layer 1, while the server's request needs layer 0's experts first
        other.acquire(1, list(range(CACHE_SLOTS)))
        status, body, headers = request_with_headers("POST", server.base_url + "/v1/chat/completions",
                                                     json.dumps(chat_request()).encode())
        assert status == 503, body
        error = body["error"]
        assert (error["type"], error["code"]) == ("service_unavailable_error", "expert_capacity_exhausted"), error
        assert headers.get("Retry-After") == "1"
        assert_no_path(body, server_paths(daemon.socket))
        assert get(server.base_url + "/health")[0] == 200
    assert metric(get(server.base_url + "/metrics")[1], CAPACITY_TOTAL) == before + 1
    log = new_log(server, seen)
    assert "has no room" in log and "Traceback" not in log, log
    status, body = post(server.base_url + "/v1/chat/completions", chat_request())
    assert status == 200, body  # the other client's pins went with its session: retrying succeeds


def test_a_corrupt_object_in_the_local_pack_is_a_502_expert_data_loss(tmp_path_factory):
    bundle = tmp_path_factory.mktemp("faulty-local") / "bundle-with-a-recognizable-path"
    shutil.copytree(tiny_bundle(tmp_path_factory), bundle)
    with serving(bundle, model_name=MODEL) as server:
        seen = len(server.lines)
        with corrupted(bundle / "experts.pack"):
            status, body = post(server.base_url + "/v1/completions",
                                {"model": MODEL, "prompt": "hello", "max_tokens": 1})
            assert status == 502, body
            assert body["error"]["code"] == "expert_data_loss"
            assert_no_path(body, server_paths(bundle / "experts.pack"))
            assert get(server.base_url + "/health")[0] == 200
        assert metric(get(server.base_url + "/metrics")[1], DATA_LOSS_TOTAL) == 1
        log = new_log(server, seen)
        assert "expert data loss" in log and "checksum" in log and "Traceback" not in log, log


@pytest.mark.parametrize(("message", "shown"), [
    ("storaged at /tmp/sd-1/sd.sock has 2 slots", f"storaged at {HIDDEN_PATH} has 2 slots"),
    ("connect to unix:/run/storaged/sd.sock: refused", f"connect to unix:{HIDDEN_PATH}: refused"),
    ("/srv/b/experts.pack: object (layer 1, expert 2) at byte 3: short read",
     f"{HIDDEN_PATH}: object (layer 1, expert 2) at byte 3: short read"),
    ("in '/srv/b/x.pack'", f"in '{HIDDEN_PATH}'"),
    ("from ~/models/b.", f"from {HIDDEN_PATH}."),
    ("see ./b and ../c", f"see {HIDDEN_PATH} and {HIDDEN_PATH}"),
    ("(/a/b), [/c]", f"({HIDDEN_PATH}), [{HIDDEN_PATH}]"),
    ("path=/srv/x", f"path={HIDDEN_PATH}"),
    ("read failed on /dev/nvme0n1", f"read failed on {HIDDEN_PATH}"),
    # not paths: kept
    ("see http://127.0.0.1:8000/v1/models", "see http://127.0.0.1:8000/v1/models"),
    ("layers 0/1 of 2/3, ratio a/b", "layers 0/1 of 2/3, ratio a/b"),
    ("2^32 / 2", "2^32 / 2"),
], ids=lambda value: value[:24])
def test_public_blanks_paths_and_nothing_else(message, shown):
    assert public(message) == shown
