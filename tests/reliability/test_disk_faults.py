"""Disk faults under a live daemon: EIO and short reads injected into chosen objects' byte ranges of
the pack by an LD_PRELOAD library (faultshim.c, built with the system C compiler into a temp dir).

The daemon runs with the library preloaded: its pread/preadv calls on the pack fail for the chosen
ranges, as a bad sector (EIO) or a file that ends early (short read) would, and pass everywhere
else. Every Acquire of a faulted object must fail with UNAVAILABLE naming the object (its bytes
are not available now; DATA_LOSS is for bytes that were read and are wrong), each failed read must
add one to io_errors_total on /metrics, the daemon must keep running and serve every other object
byte-identical.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from packformat import PackReader
from reliability_kit import daemon_device, free_port, scrape
from storaged.client import StorageClient, StorageError
from storaged_testkit import SLOT_BYTES, TEST_EXPERTS, TEST_LAYERS, daemon_env, start_daemon

SHIM_SOURCE = Path(__file__).with_name("faultshim.c")
EXPECTED_CODE = "UNAVAILABLE"
# object → (kind, first faulted byte inside the object, last + 1; None: the object's end)
FAULTS = {
    (1, 2): ("eio", 0, None),  # the whole object unreadable
    (2, 5): ("eio", 5000, 5001),  # one bad byte inside it
    (4, 7): ("eio", 8000, None),  # its tail
    (1, 6): ("short", 0, None),  # the file "ends" where the object starts: a read returns 0
    (2, 0): ("short", 4096, None),  # ends one aligned block into it
    (4, 3): ("short", 1000, None),  # ends at an unaligned offset inside it
}
ATTEMPTS = 2  # Acquires of each faulted object: a failed load is not cached, each one reads again


@pytest.fixture(scope="module")
def faultshim(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) to build the LD_PRELOAD fault library tests/reliability/faultshim.c")
    library = tmp_path_factory.mktemp("faultshim") / "faultshim.so"
    build = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library),
                            str(SHIM_SOURCE), "-ldl"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return library


def _fault_env(library: Path, pack: Path, log: Path) -> dict[str, str]:
    ranges: dict[str, list[str]] = {"eio": [], "short": []}
    with PackReader(pack) as reader:
        for (layer, expert), (kind, start, end) in FAULTS.items():
            entry = reader.entry(layer, expert)
            stop = entry.offset + (entry.padded_size if end is None else end)
            ranges[kind].append(f"{entry.offset + start}-{stop}")
    return daemon_env(LD_PRELOAD=str(library), FAULTSHIM_PATH=str(pack.resolve()), FAULTSHIM_LOG=str(log),
                      FAULTSHIM_EIO=",".join(ranges["eio"]), FAULTSHIM_SHORT=",".join(ranges["short"]))


def _calls_by_object(pack: Path, injected: list[str]) -> dict[tuple[int, int], list[str]]:
    """The shim's log lines (one per faulted read call) grouped by the object whose bytes they read."""
    calls: dict[tuple[int, int], list[str]] = {key: [] for key in FAULTS}
    with PackReader(pack) as reader:
        for line in injected:
            offset = int(line.split()[1])
            key = next(k for k in FAULTS if reader.entry(*k).offset <= offset < reader.entry(*k).offset
                       + reader.entry(*k).padded_size)
            calls[key].append(line)
    return calls


@pytest.mark.parametrize("direct_io", [pytest.param(True, id="O_DIRECT"),
                                       pytest.param(False, id="buffered", marks=pytest.mark.slow)])
def test_injected_read_faults_are_counted_refused_and_the_rest_served(disk_dir, bundle, faultshim, figures,
                                                                      direct_io):
    name = "direct" if direct_io else "buffered"
    directory = disk_dir / f"faults-{name}"
    directory.mkdir()
    log = directory / "faults.log"
    metrics = f"127.0.0.1:{free_port()}"
    env = _fault_env(faultshim, bundle.path / "experts.pack", log)
    daemon = start_daemon(directory, {"tiny": bundle.path}, env=env, vram_cache_bytes=10 * SLOT_BYTES,
                          metrics_address=metrics, direct_io=direct_io, **daemon_device())
    outcomes: dict[tuple[int, int], list[str]] = {}
    served = 0
    try:
        before = scrape(metrics)["io_errors_total"]
        with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
            for (layer, expert), (kind, _, _) in FAULTS.items():
                for _ in range(ATTEMPTS):
                    try:
                        session.acquire(layer, [expert])
                        outcomes.setdefault((layer, expert), []).append("OK")
                    except StorageError as exc:
                        assert f"layer {layer}, expert {expert}" in str(exc), exc
                        outcomes.setdefault((layer, expert), []).append(exc.code.name)
            for layer in TEST_LAYERS:
                healthy = [e for e in range(TEST_EXPERTS) if (layer, e) not in FAULTS]
                for expert, slot in zip(healthy, session.acquire(layer, healthy, release_other_layers=True)):
                    data = bundle.payloads[(layer, expert)]
                    served += session.slot_bytes(slot, len(data)).cpu().numpy().tobytes() == data
        counted = scrape(metrics)["io_errors_total"] - before
        alive = daemon.process.poll() is None
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    injected = log.read_text().splitlines() if log.exists() else []
    by_kind = {kind: sorted({code for key, codes in outcomes.items() if FAULTS[key][0] == kind for code in codes})
               for kind in ("eio", "short")}
    healthy_total = len(bundle.payloads) - len(FAULTS)
    figures.record(f"disk_faults_{name}", faulted_objects=len(FAULTS), reads=len(FAULTS) * ATTEMPTS,
                   injected_calls=len(injected), counted=int(counted), codes=by_kind, others_served=served,
                   others=healthy_total, daemon_alive=alive)
    assert alive
    assert all(code != "OK" for codes in outcomes.values() for code in codes), outcomes
    assert served == healthy_total
    assert counted == len(FAULTS) * ATTEMPTS  # one per failed object read
    # a short read may take two calls (some bytes, then none): at least one per read of each object
    assert all(len(calls) >= ATTEMPTS for calls in _calls_by_object(bundle.path / "experts.pack", injected).values())
    assert by_kind == {"eio": [EXPECTED_CODE], "short": [EXPECTED_CODE]}, outcomes
