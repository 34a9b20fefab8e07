"""Peak RSS of `packtools build` against source size: bounded memory means a flat column.

For each format (GGUF with Q4_K experts, Hugging Face bf16 safetensors) it synthesizes models of
increasing size and builds each in a fresh `python -m packtools build` process that reports its
own peak RSS (VmHWM) as it exits. Two series: `experts` grows the routed experts (more experts
per layer, same layers), `dense` grows the dense weights (more layers, 8 experts each). The
import floor is the peak RSS of a process that only imports what build imports, so "build -
floor" is what the build itself adds. Each source and bundle is deleted before the next is made,
so the disk holds one source and one bundle at a time.

Not ru_maxrss from wait4: Linux keeps ru_maxrss across exec, so a child forked from this
(synthesis-sized) process would report this process's size.

    python bench/build_rss.py                          # both series, both formats, ~1.8 GB largest
    python bench/build_rss.py --series experts --formats gguf --experts 8 64 --workdir /mnt/scratch
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

LAYERS = 4  # experts series
DENSE_SERIES_EXPERTS = 8
HIDDEN = 1024
# expert width per format, chosen so one expert is ~1.6-1.8 MB in both (Q4_K: 0.5625 B/element)
FORMATS = {
    "gguf": {"expert_type": "Q4_K", "moe_intermediate_size": 1024},
    "hf": {"expert_type": "bfloat16", "moe_intermediate_size": 256},
}
FLOOR_IMPORTS = "import packtools.build, packtools.gguf.source, packtools.sources.hf"
REPORT_PEAK = """
peak_kb = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]
print("VmHWM", int(peak_kb) * 1024)
"""
MEASURED_BUILD = "import sys\nfrom packtools.cli import main\ncode = main(sys.argv[1:])\n" + REPORT_PEAK + "sys.exit(code)\n"


@dataclasses.dataclass(frozen=True)
class Child:
    seconds: float
    peak_rss: int  # bytes
    output: str


def run_child(code: str, args: list[str]) -> Child:
    """Run Python `code` (which prints its VmHWM) in a fresh process; its wall time and peak RSS."""
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {run.returncode}:\n{run.stderr[-3000:]}")
    return Child(seconds, int(run.stdout.split("VmHWM ")[1].split()[0]), run.stdout)


def synthesize(fmt: str, experts: int, layers: int, where: Path) -> tuple[Path, int]:
    """A random qwen3_moe model in `where`; returns its path and its routed expert bytes."""
    sizes = dict(hidden_size=HIDDEN, num_layers=layers, num_experts=experts, top_k=2,
                 moe_intermediate_size=FORMATS[fmt]["moe_intermediate_size"], vocab_size=512)
    if fmt == "gguf":
        from packformat.constants import ElementType
        from packtools.synth.gguf_cli import synth_gguf_model
        from packtools.synth.gguf_models import expert_bytes, tiny_config_with

        kind = ElementType[FORMATS[fmt]["expert_type"]]
        (path,) = synth_gguf_model("qwen3_moe", where / "model.gguf", seed=0, expert_type=kind.name,
                                   stream_threshold_bytes=0, **sizes)  # experts streamed, never all in RAM
        return path, expert_bytes(tiny_config_with("qwen3_moe", **sizes), kind)
    from packtools.synth.hf import synth_hf

    result = synth_hf("qwen3_moe", where / "hf", seed=0, dtype=FORMATS[fmt]["expert_type"], stream_threshold_bytes=0,
                      max_shard_bytes=512 * 1024**2, **sizes)
    return result.out_dir, result.expert_bytes


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: int) -> str:
    return f"{n / 1024**2:,.0f} MiB"


def cases(series: list[str], experts: list[int], layers: list[int]) -> list[tuple[str, int, int]]:
    chosen = []
    if "experts" in series:
        chosen += [("experts", count, LAYERS) for count in experts]
    if "dense" in series:
        chosen += [("dense", DENSE_SERIES_EXPERTS, count) for count in layers]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", nargs="+", choices=("experts", "dense"), default=["experts", "dense"])
    parser.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=["gguf", "hf"])
    parser.add_argument("--experts", nargs="+", type=int, default=[8, 64, 256],
                        help=f"experts series: routed experts per layer ({LAYERS} layers, hidden {HIDDEN})")
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 16, 48],
                        help=f"dense series: layers ({DENSE_SERIES_EXPERTS} experts each, hidden {HIDDEN})")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)
    logging.getLogger("gguf").setLevel(logging.ERROR)  # gguf-py's vocab notes while synthesizing

    scratch = Path(tempfile.mkdtemp(prefix="build-rss-", dir=args.workdir))
    try:
        floor = run_child(FLOOR_IMPORTS + REPORT_PEAK, [])
        print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  {platform.machine()}, "
              f"{os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 1024**3:.0f} GiB, "
              f"Python {platform.python_version()}")
        print(f"# import floor (a process that only imports the build modules): peak RSS {mib(floor.peak_rss)}")
        print("| series | source | experts x layers | expert bytes | dense bytes | source on disk | build time "
              "| peak RSS | RSS - floor |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for series, experts, layers in cases(args.series, args.experts, args.layers):
            for fmt in args.formats:
                case = scratch / f"{fmt}-{experts}x{layers}"
                case.mkdir()
                source, expert_bytes = synthesize(fmt, experts, layers, case)
                bundle = case / "bundle"
                build = run_child(MEASURED_BUILD, ["build", str(source), "-o", str(bundle), "--quiet"])
                print(f"| {series} | {fmt} {FORMATS[fmt]['expert_type']} | {experts} x {layers} | {mib(expert_bytes)} "
                      f"| {mib((bundle / 'dense.safetensors').stat().st_size)} | {mib(disk_bytes(source))} "
                      f"| {build.seconds:.1f} s | {mib(build.peak_rss)} | {mib(build.peak_rss - floor.peak_rss)} |",
                      flush=True)
                shutil.rmtree(case)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
