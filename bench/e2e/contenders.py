"""The contenders, each built for one VRAM budget inside the benchmark's child process:
  resident          the model fully resident in transformers (experts dequantized to the run dtype once,
                    computed by transformers' own experts forward)
  accelerate        HF accelerate disk offload: from_pretrained(device_map, max_memory, offload_folder)
  gguf_mmap         the naive on-demand loader, bench.e2e.gguf_mmap_source (the "native GGUF path")
  storaged          storaged (O_DIRECT, io_parallelism 16, a host-RAM tier of the same bytes as the VRAM
                    budget, inside the same RAM limit as every contender) through StoragedExpertSource:
                    fused kernels, lookahead prefetch (top-k), decode steps as CUDA graphs reading
                    the slot map
  storaged_preload  storaged as above started with --preload (both tiers filled at start, while it serves),
                    timed once the preload ended: the first request after an operator's restart
  storaged_preload_cpu  storaged_preload with CPU threads computing a share of each decode step's host-tier
                    experts (inference.experts.cpu_experts; CUDA and a host tier only, skipped otherwise)
  storaged_no_lookahead  storaged as above without lookahead hints: what the hints cost or save in SSD
                    bytes and time
  storaged_copy_up  storaged as above, but host-tier experts copied up to VRAM by an Acquire (the daemon's
                    promotion) rather than read in place over the link (inference.experts.host_reads)
  storaged_io4      storaged as above with io_parallelism 4 (the daemon's default) rather than 16: this
                    disk reads 2.7 MB objects fastest with four in flight (bench/disk_probe.py), and a
                    budget below the working set is bound by its reads
  storaged_serial   storaged with io_parallelism 1, no host tier, no lookahead, one acquire per layer:
                    the published SGLang design's serial miss path
  llamacpp          llama.cpp's llama-bench on the same GGUF, -ngl 99 plus --n-cpu-moe for the layers whose
                    experts do not fit the budget (bench.e2e.llamacpp_command); not a torch model: the
                    runner hands it to bench.e2e.llamacpp_run
A built contender is the model plus what the measurement needs from it (processes whose reads
count, cache statistics, and what to close)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.e2e.prepare import PreparedModel

if TYPE_CHECKING:
    from bench.storaged_runs import StoragedProcess

STORAGED_MODEL = "bench"
PRELOAD_WAIT_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class StoragedVariant:
    """How one storaged contender is configured."""

    io_parallelism: int = 16
    host_tier: bool = True  # host bytes = the VRAM budget's
    fast_path: bool = True  # decode steps as CUDA graphs reading the slot map (else eager, an Acquire a layer)
    lookahead: bool = True  # top-k hints for the next layer
    host_reads: bool = True  # host-tier experts read in place (else copied up by an Acquire)
    preload: bool = False  # the daemon fills its tiers at start; timed once that ended
    cpu_experts: bool = False  # CPU threads compute a share of each step's host-tier experts (CUDA)


# the CPU experts' threads: the host's cores less a few for the daemon, the engine and the link's driver
CPU_EXPERTS_THREADS = max(1, min(12, (os.cpu_count() or 4) - 4))
STORAGED_VARIANTS = {
    "storaged": StoragedVariant(),
    "storaged_preload": StoragedVariant(preload=True),
    "storaged_preload_cpu": StoragedVariant(preload=True, cpu_experts=True),
    "storaged_no_lookahead": StoragedVariant(lookahead=False),
    "storaged_copy_up": StoragedVariant(host_reads=False),
    "storaged_io4": StoragedVariant(io_parallelism=4),
    "storaged_serial": StoragedVariant(io_parallelism=1, host_tier=False, fast_path=False, lookahead=False,
                                       host_reads=False),
}
CONTENDERS = ("resident", "accelerate", "gguf_mmap", *STORAGED_VARIANTS, "llamacpp")


class ContenderSkipped(Exception):
    """This contender cannot run here or at this budget; the message is the stated reason."""


@dataclasses.dataclass
class BuiltContender:
    model: torch.nn.Module
    reader_pids: list  # processes whose /proc/<pid>/io read_bytes are the contender's disk reads
    notes: list[str]
    # objects read from the pack so far (storaged's reads, prefetches included); None: not counted
    pack_reads: Callable[[], int | None] = lambda: None
    closers: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    decoder: object | None = None  # a StaticDecoder that decodes instead of the model's KV cache loop
    # host RAM the contender allocated as its own expert cache (storaged's host tier): part of its
    # RAM budget already, so the page cache gets only the rest of the budget
    host_cache_bytes: int = 0
    # runs after the warm-up, before the timed request (storaged_preload: waits for the preload to
    # end); → a note for the run, or None
    before_timing: Callable[[], str | None] = lambda: None

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def budget_bytes(model: PreparedModel, fraction: float) -> int:
    """`fraction` of every routed expert's pack object (padded slots), in bytes."""
    from packformat.bundle import open_bundle

    with open_bundle(model.bundle_dir) as bundle:
        stride, objects = bundle.pack.header.object_stride, len(list(bundle.pack))
    return int(fraction * objects * stride)


def _resident(model: PreparedModel, fraction: float, device: torch.device, dtype: torch.dtype,
              workdir: Path) -> BuiltContender:
    from bench.e2e.resident import load_resident

    if fraction < 1.0:
        raise ContenderSkipped("fully resident only runs at 100% (it holds every expert)")
    expert_bytes = model.shape.bf16_expert_bytes * model.shape.experts * model.moe_layers * dtype.itemsize // 2
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if expert_bytes > 0.85 * free:
            raise ContenderSkipped(f"dequantized experts need {expert_bytes / 2**30:.1f} GiB, "
                                   f"{free / 2**30:.1f} GiB of VRAM is free")
    loaded, implementation = load_resident(model.bundle_dir, device=device, dtype=dtype)
    return BuiltContender(loaded.model, ["self"],
                          [f"experts dequantized to {dtype} ({expert_bytes / 2**30:.2f} GiB), transformers' "
                           f"{implementation!r} experts forward"], closers=[loaded.close])


def _accelerate(model: PreparedModel, fraction: float, device: torch.device, dtype: torch.dtype,
                workdir: Path) -> BuiltContender:
    from transformers import AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401 - transformers' device_map needs it
    except ImportError:
        raise ContenderSkipped("accelerate is not installed") from None
    if model.hf_dir is None:
        raise ContenderSkipped("no bf16 Hugging Face checkpoint was prepared for this shape (disk/time budget)")
    budget = budget_bytes(model, fraction)
    dense = (model.bundle_dir / "dense.safetensors").stat().st_size
    offload = workdir / "accelerate-offload"
    offload.mkdir(parents=True, exist_ok=True)
    # the same bytes of VRAM for weights as storaged's arena, plus the dense weights every contender holds
    if device.type == "cuda":  # nothing kept in host RAM: beyond the VRAM budget it is disk offload
        max_memory = {device.index or 0: dense + budget, "cpu": 0}
    else:
        max_memory = {"cpu": dense + budget}
    loaded = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=dtype, device_map="auto",
                                                  max_memory=max_memory, offload_folder=str(offload))
    placement = sorted(set(map(str, getattr(loaded, "hf_device_map", {}).values())))
    return BuiltContender(loaded.eval(), ["self"], [f"max_memory {max_memory}, placement {placement}; experts bf16"])


def _gguf_mmap(model: PreparedModel, fraction: float, device: torch.device, dtype: torch.dtype,
               workdir: Path) -> BuiltContender:
    from bench.e2e.gguf_mmap_source import GGUFMmapSource
    from inference.model import load_model

    loaded = load_model(model.bundle_dir, device=device, dtype=dtype,
                        expert_source=lambda bundle, dev: GGUFMmapSource(model.gguf_path, bundle, dev))
    return BuiltContender(loaded.model, ["self"], ["no cache of its own: the page cache, under the RAM limit"],
                          closers=[loaded.expert_source.close, loaded.close])


def start_storaged(model: PreparedModel, fraction: float, device: torch.device, workdir: Path, *,
                   io_parallelism: int, host_tier: bool, layer_floor: bool = False,
                   preload: bool = False) -> tuple[StoragedProcess, int, list[str]]:
    """storaged serving `model` as STORAGED_MODEL with an arena of `fraction` of its experts' slots;
    returns (the StoragedProcess, its host tier's bytes, notes). With `layer_floor` the arena is
    raised to one layer's experts where the budget is below that (a prefill then pins a layer's
    demand at once); without it, a layer touching more experts than the arena holds is computed in
    groups (inference.experts.forward). The host tier, with `host_tier`, holds as many bytes as
    the VRAM budget (what the RAM limit leaves room for), and never at 100% or on the CPU."""
    from bench.storaged_runs import StoragedProcess
    from packformat.bundle import open_bundle

    with open_bundle(model.bundle_dir) as bundle:
        stride = bundle.pack.header.object_stride
    budget = budget_bytes(model, fraction)
    floor = model.shape.experts * stride if layer_floor else 0
    host_bytes = budget if host_tier and fraction < 1.0 and device.type == "cuda" else 0
    notes = [f"io_parallelism {io_parallelism}, host tier {host_bytes} bytes, O_DIRECT, checksums on"]
    if budget < floor:
        notes.append(f"arena raised from {budget} to {floor} bytes: one layer's experts must fit pinned")
    daemon_device = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    daemon = StoragedProcess(model.bundle_dir, model=STORAGED_MODEL, device=daemon_device,
                             vram_bytes=max(budget, floor), io_parallelism=io_parallelism, host_bytes=host_bytes,
                             staging_buffers=max(io_parallelism, 2), extra_args=("--preload",) if preload else (),
                             log_path=workdir / f"storaged-{io_parallelism}{'-preload' if preload else ''}-{fraction}.log")
    if preload:
        notes.append("tiers preloaded at start (--preload)")
    return daemon, host_bytes, notes


def _storaged(model: PreparedModel, fraction: float, device: torch.device, dtype: torch.dtype, workdir: Path,
              variant: StoragedVariant, *, static_len: int, layer_floor: bool) -> BuiltContender:
    from inference.experts.storaged_source import StoragedExpertSource
    from inference.model import load_model

    daemon, host_bytes, notes = start_storaged(model, fraction, device, workdir, io_parallelism=variant.io_parallelism,
                                               host_tier=variant.host_tier, layer_floor=layer_floor,
                                               preload=variant.preload)
    host_reads, lookahead = variant.host_reads, model.shape.top_k if variant.lookahead else 0
    if variant.cpu_experts and (device.type != "cuda" or not host_bytes):
        daemon.stop(check=False)
        raise ContenderSkipped("CPU experts share the host tier's experts of CUDA graph decode steps: "
                               + ("no CUDA here" if device.type != "cuda" else "no host tier at this budget"))
    try:
        socket = str(daemon.socket_dir / "s.sock")
        loaded = load_model(model.bundle_dir, device=device, dtype=dtype, lookahead=lookahead,
                            expert_source=lambda bundle, dev: StoragedExpertSource(socket, STORAGED_MODEL, bundle, dev,
                                                                                   host_reads=host_reads))
    except BaseException:
        daemon.stop(check=False)
        raise
    decoder = None
    if variant.fast_path:
        from inference.engine.decode_graph import StaticDecoder, why_not
        from inference.engine.generate import _cache_keyword

        cpu_experts = None
        if variant.cpu_experts:
            from inference.experts.cpu_experts import DEFAULT_SHARE, CpuExpertsConfig

            cpu_experts = CpuExpertsConfig(CPU_EXPERTS_THREADS)
            notes.append(f"{CPU_EXPERTS_THREADS} CPU threads compute a share of each layer's host-tier experts, tuned "
                         f"while decoding from {DEFAULT_SHARE}")
        try:
            decoder = StaticDecoder.create(loaded.model, loaded.expert_source, max_len=static_len,
                                           cache_keyword=_cache_keyword(loaded.model), cpu_experts=cpu_experts)
        except BaseException:
            loaded.close()
            daemon.stop(check=False)
            raise
        notes.append(f"lookahead {lookahead} experts/token; decode "
                     + ("steps as CUDA graphs reading the slot map" if decoder and decoder.capture else
                        "steps uncaptured through the slot map" if decoder else
                        f"eager ({why_not(loaded.model, loaded.expert_source, device)})"))
    else:
        notes.append("no lookahead, eager decode with one acquire per layer (the serial design)")
    if host_bytes:
        notes.append("host-tier experts read in place by the fused kernels" if host_reads else
                     "host-tier experts copied up to VRAM by an Acquire")

    # Not the VRAM tier's hit counter: experts read in place from either tier make no lookup at all.
    def pack_reads() -> int:
        return daemon.client.stats().reads

    def preload_ended() -> str:
        waited, deadline = time.perf_counter(), time.perf_counter() + PRELOAD_WAIT_SECONDS
        while True:
            stats = daemon.client.stats()  # a fresh daemon's preload reads at least one expert
            if stats["preload_loads_total"] > 0 and stats["preloading"] == 0:
                return (f"the preload read {int(stats['preload_loads_total'])} experts; timed "
                        f"{time.perf_counter() - waited:.1f} s after the warm-up, once it had ended")
            if time.perf_counter() > deadline:
                return f"timed while the preload was still reading ({PRELOAD_WAIT_SECONDS:.0f} s after the warm-up)"
            time.sleep(0.05)

    return BuiltContender(loaded.model, ["self", daemon.process.pid], notes, pack_reads=pack_reads,
                          closers=[*([decoder.close] if decoder is not None else []), daemon.stop, loaded.close,
                                   loaded.expert_source.close], host_cache_bytes=host_bytes,
                          decoder=decoder, before_timing=preload_ended if variant.preload else lambda: None)


def build_contender(name: str, model: PreparedModel, fraction: float, device: torch.device, dtype: torch.dtype,
                    workdir: Path, *, static_len: int = 4096, layer_floor: bool = False) -> BuiltContender:
    """The contender `name` at a VRAM budget of `fraction` of the experts; raises ContenderSkipped.
    `layer_floor`: storaged's arena is raised to one layer's experts (start_storaged)."""
    if name in STORAGED_VARIANTS:
        return _storaged(model, fraction, device, dtype, workdir, STORAGED_VARIANTS[name], static_len=static_len,
                         layer_floor=layer_floor)
    if name == "llamacpp":
        raise ValueError("llamacpp is an external process, run by bench.e2e.llamacpp_run, not a torch model")
    builders = {"resident": _resident, "accelerate": _accelerate, "gguf_mmap": _gguf_mmap}
    if name not in builders:
        raise ValueError(f"unknown contender {name!r}; known: {CONTENDERS}")
    return builders[name](model, fraction, device, dtype, workdir)
