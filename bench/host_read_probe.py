"""The experts GEMV reading objects in place from pinned host memory, against the copy engine.

Where VRAM holds half of the experts and host RAM the other half, a decode step needs ~half of its
experts from the host tier. Either they are copied to VRAM first (the copy engine, one round trip
to storaged per layer), or the fused GEMV reads their quantized bytes in place over the link
(host memory registered with the device, "zero copy"). This measures, per expert type of the
bench shapes, one token's experts of a layer:

    vram    the GEMV over objects in VRAM (the all-hit case)
    host    the same GEMV, the objects in page-locked host memory mapped into the device
    copy    the copy engine moving the same objects host → VRAM (what a promotion costs)
    shapes  the host case at the largest count, per GEMV launch shape (rows per program, warps)
    ceiling what the link gives plain wide loads (a sum over the mapped bytes, read in place),
            and what the CPU reads the same bytes at (a sum on the host's threads): the two rates
            a decode step's host-tier experts could be computed at, on the GPU or on the CPU

    python bench/host_read_probe.py --types Q4_K MXFP4 --json out.json

Calls rotate over `--experts` distinct objects (more than the GPU's L2), each timed in a CUDA
graph; the host case's GB/s of weights read is printed against the copy engine's in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.gemv_sweep import CONFIGS, SHAPES, _layer  # noqa: E402
from inference.kernels import ops  # noqa: E402
from storaged.device.cuda_driver import DriverApi  # noqa: E402


class MappedBytes:
    """Host memory registered with the device, as the kernels take it: a device address and a dtype."""

    dtype = torch.uint8

    def __init__(self, device_address: int):
        self._address = device_address

    def data_ptr(self) -> int:
        return self._address


class MappedView:
    """A CUDA tensor over `nbytes` of registered host memory at `device_address` (int64 words), so
    torch's own kernels read it in place over the link."""

    def __init__(self, device_address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes // 8,), "typestr": "<i8", "data": (device_address, False),
                                         "version": 3}


def _ceilings(host: torch.Tensor, device_address: int) -> dict:
    """GB/s of a plain sum over the host bytes: on the GPU reading them in place, on the CPU's threads."""
    words = torch.as_tensor(MappedView(device_address, host.numel()), device="cuda")  # [n / 8] int64, in host RAM
    sm_us = _graph_us([lambda: words.sum()], rounds=3)
    cpu_words = host.view(torch.int64)
    threads = torch.get_num_threads()
    cpu = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        cpu_words.sum()
        start = time.perf_counter()
        for _ in range(3):
            cpu_words.sum()
        cpu[n] = host.numel() * 3 / (time.perf_counter() - start) / 1e9
    torch.set_num_threads(threads)
    return {"bytes": host.numel(), "gpu_in_place_gbps": host.numel() / sm_us / 1e3,
            "cpu_gbps_by_threads": {str(n): v for n, v in cpu.items()}, "cpu_count": os.cpu_count()}


def _graph_us(calls, rounds: int = 5) -> float:
    """Microseconds per call of `calls` (a list of thunks), captured once in a CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (rounds * len(calls))


def probe(type_name: str, experts: int, counts: list[int]) -> dict:
    element_type, hidden, inter, top_k, device, arena, slot_bytes, (gate, up, down), up_w, down_w = \
        _layer(type_name, experts)
    host = arena.cpu()  # [experts * slot_bytes] uint8, page-aligned from the allocator
    driver = DriverApi(device.index or 0)
    mapped = MappedBytes(driver.register_mapped(host.data_ptr(), host.numel()))
    try:
        object_bytes = gate.nbytes + up.nbytes + down.nbytes
        slot_map = torch.arange(experts, dtype=torch.int32, device=device)
        x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
        staging = torch.empty(max(counts) * slot_bytes, dtype=torch.uint8, device=device)
        rows = []
        for k in counts:
            h = torch.randn(k, inter, device=device, dtype=torch.bfloat16)
            sets = [torch.arange(i, i + k, device=device) % experts for i in range(0, experts, k)]

            def gemv(source, index, k=k, h=h, tuning=None):
                return lambda: (ops.moe_gemv(x, index, slot_map, source, slot_bytes, up_w, top_k=k, tuning=tuning),
                                ops.moe_gemv(h, index, slot_map, source, slot_bytes, down_w, top_k=k, x_per_pair=True,
                                             tuning=tuning))

            def copy(first, k=k):
                def run():
                    for j in range(k):
                        slot = (first + j) % experts
                        staging[j * slot_bytes:(j + 1) * slot_bytes].copy_(
                            host[slot * slot_bytes:(slot + 1) * slot_bytes], non_blocking=True)
                return run

            vram_us = _graph_us([gemv(arena, s) for s in sets])
            host_us = _graph_us([gemv(mapped, s) for s in sets])
            copy_us = _graph_us([copy(int(s[0])) for s in sets])
            moved = k * object_bytes
            rows.append({"experts": k, "object_bytes": object_bytes, "vram_us": vram_us, "host_us": host_us,
                         "copy_us": copy_us, "host_gbps": moved / host_us / 1e3, "copy_gbps": moved / copy_us / 1e3,
                         "host_vs_copy_then_vram": (copy_us + vram_us) / host_us})
            if k == max(counts):
                shapes = []
                for block_n, warps in CONFIGS:
                    us = _graph_us([gemv(mapped, s, tuning=(block_n, warps)) for s in sets])
                    shapes.append({"block_n": block_n, "warps": warps, "host_us": us, "host_gbps": moved / us / 1e3})
        return {"type": type_name, "hidden": hidden, "intermediate": inter, "top_k": top_k, "rows": rows,
                "shapes": shapes, "ceiling": _ceilings(host, mapped.data_ptr())}
    finally:
        torch.cuda.synchronize()
        driver.unregister(host.data_ptr())
        driver.close()


def report(result: dict) -> str:
    lines = [f"{result['type']}: objects of {result['rows'][0]['object_bytes'] / 1e6:.2f} MB "
             f"(hidden {result['hidden']}, intermediate {result['intermediate']})"]
    for r in result["rows"]:
        lines.append(f"  {r['experts']:2d} experts: vram {r['vram_us']:7.1f} us | host in place {r['host_us']:7.1f} us "
                     f"({r['host_gbps']:5.1f} GB/s) | copy engine {r['copy_us']:7.1f} us ({r['copy_gbps']:5.1f} GB/s) "
                     f"| in place ÷ (copy + vram) {r['host_vs_copy_then_vram']:.2f}x")
    k = result["rows"][-1]["experts"]
    lines.append(f"  {k} experts in place, per launch shape (rows per program, warps): " + ", ".join(
        f"({r['block_n']},{r['warps']}) {r['host_gbps']:.1f}" for r in result["shapes"]) + " GB/s")
    c = result["ceiling"]
    lines.append(f"  a sum over {c['bytes'] / 1e6:.0f} MB of host memory: GPU in place {c['gpu_in_place_gbps']:.1f} GB/s; CPU "
                 + ", ".join(f"{n} threads {v:.1f}" for n, v in c["cpu_gbps_by_threads"].items()) + " GB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--experts", type=int, default=64, help="distinct objects the calls rotate over")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 4, 8], help="experts per call")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_read_probe needs CUDA", file=sys.stderr)
        return 2
    results = [probe(t, args.experts, args.counts) for t in args.types]
    for result in results:
        print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
