"""Host-tier experts shared between the GPU and the CPU in a decode step.

With storaged's host tier read in place (inference.experts.host_reads), the host-tier experts of
a decode step cross the link: about 40-50 GB/s, the bound of a step at a 50% + 50% budget. The
CPU's cores read host memory too, so a share of each layer's host-tier experts is computed whole
by a pool of CPU threads (inference.kernels.host_experts) while the GPU computes the rest, its
VRAM experts and the other host-tier ones (inference.kernels.handoff), one handoff a layer:

    the device posts x and the CPU's pairs -> the GPU's gate/up GEMVs, activation, down GEMVs of
    the other pairs -> collect: the CPU's down rows into the GPU's -> the combine

The CPU's rows equal the GPU's but for float32 summation order (bf16-rounded weights, float32
sums, bf16 results) and its activation: SiLU(gate) * up rounded as torch's bfloat16 ops round,
with the module's clamp where it has one (`limit`, e.g. DeepSeek-V4). Before a layer is shared,
the pool's activation is checked against the module's own on a probe (agreeing to bf16 rounding
of the exponential); a layer whose activation is another is left to the GPU (logged). The share is
a fraction of the host-tier experts each layer uses, read by the device at every step: fixed when
`cpu_experts_share` is given, else tuned on the decode steps' own times (inference.experts.
share_tuner), starting at DEFAULT_SHARE.

Where it applies: the captured decode step (device lookup) of layers whose fused GEMV reads the
host tier in place, weights of a type the CPU kernels read (Q4_K, MXFP4), bfloat16 models.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from fractions import Fraction

import torch

from inference.experts.share_tuner import ShareTuner
from inference.kernels import handoff
from inference.kernels.host_experts import HostExpertsPool, HostExpertsUnavailable, readable

log = logging.getLogger(__name__)
# where the tuner starts (and the share when tuning is off): measured on the H200 host (12 threads,
# docs/benchmarks.md), DeepSeek-like MXFP4 experts 328 tok/s at 0.35 and 318 at 0.5 against 250 on the
# GPU alone; Qwen3-like Q4_K within run-to-run noise at 0.35-0.65
DEFAULT_SHARE = 0.35
TUNER_LEVELS = 16  # the tuned share moves in sixteenths
TIMEOUT_NS = 200_000_000  # a pool this late is gone: the step is redone on the acquire path
# the copy agent's scratch slots: a layer's host-tier experts beyond them (in a batch) are read in place
COPY_SLOTS = 16


@dataclasses.dataclass(frozen=True)
class CpuExpertsConfig:
    threads: int  # the pool's threads (spinning while steps run)
    share: float | None = None  # of each layer's host-tier experts; None: tuned while decoding
    copy_engine: bool = False  # the GPU's host-tier experts copied to VRAM by a copy agent, not read in place

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"cpu_experts threads {self.threads!r}: expected a positive number")
        if self.share is not None and (isinstance(self.share, bool) or not isinstance(self.share, (int, float))
                                       or not 0 < self.share <= 1):
            raise ValueError(f"cpu_experts share {self.share!r}: expected a fraction in (0, 1] (or None: tuned)")
        if not isinstance(self.copy_engine, bool):
            raise ValueError(f"cpu_experts copy_engine {self.copy_engine!r}: expected true or false")


@dataclasses.dataclass(frozen=True)
class CpuShare:
    """What one layer's decode-sized call needs to hand host-tier experts to the pool."""

    box: handoff.Mailbox
    kind: int  # the pool's expert kind of the layer
    share: torch.Tensor  # int32 [2] on the device: numerator, denominator of the host-tier experts taken
    gpu_map: torch.Tensor  # int32 [E]: scratch, static for graph capture
    cpu_pairs: torch.Tensor  # int32 [max pairs]
    max_pairs: int
    timeout_ns: int = TIMEOUT_NS
    copies: handoff.CopyBox | None = None  # the copy agent's, shared by the layers (None: read in place)
    copy_map: torch.Tensor | None = None  # int32 [E]: scratch, static for graph capture (with copies)


def why_not(binding, dtype: torch.dtype) -> str | None:
    """Why the CPU cannot take a share of this layer's host-tier experts (its weights), or None."""
    fused = binding.fused
    if fused is None:
        return f"layer {binding.layer}: not on the fused path"
    if dtype != torch.bfloat16:
        return f"layer {binding.layer}: the CPU kernels compute bfloat16 models, not {dtype}"
    if fused.up_biases or fused.down_bias is not None:
        return f"layer {binding.layer}: biases"
    for weights in (fused.up, (fused.down,)):
        why = readable(weights)
        if why is not None:
            return f"layer {binding.layer}: {why}"
    return None


def activation_mismatch(pool, kind: int, activate, intermediate: int, device: torch.device) -> str | None:
    """None when the pool's activation of `kind` agrees with `activate` (the module's, on the
    device) on a probe of gate/up rows (within one bf16 ulp, equal in at least 99% of elements),
    else what differs."""
    generator = torch.Generator().manual_seed(0)
    probe = (torch.randn(16, 2 * intermediate, generator=generator) * 4).bfloat16()  # [16, 2I], clamps exercised
    expected = activate(probe.to(device)).float().cpu()
    got = pool.activate(kind, probe).float()
    if expected.shape != got.shape:
        return f"the module's activation gives {tuple(expected.shape)}, the pool's {tuple(got.shape)}"
    close = (got - expected).abs() <= expected.abs() * 2**-7 + 1e-30
    equal = (got == expected).float().mean().item()
    if not bool(close.all()) or equal < 0.99:
        return f"the module's activation is not SiLU(gate) * up as the pool computes it ({equal:.1%} equal on a probe)"
    return None


class CpuExperts:
    """The pool of a decoder, and each layer's CpuShare."""

    def __init__(self, config: CpuExpertsConfig, bindings: dict, activations: dict, *, host_address: int,
                 host_slots: int, slot_bytes: int, max_pairs: int, device: torch.device, dtype: torch.dtype):
        """activations: layer -> (the module's activation of gate/up rows in the fused GEMV's
        order, the module's clamp limit or None)."""
        eligible = {}
        for layer, binding in bindings.items():
            reason = why_not(binding, dtype)
            if reason is None:
                eligible[layer] = binding
            else:
                log.info("CPU experts: %s; its host-tier experts are read over the link", reason)
        if not eligible:
            raise HostExpertsUnavailable("no layer's experts can be computed on the CPU (see the log)")
        hidden = max(max(b.fused.up[0].cols, b.fused.down.rows) for b in eligible.values())
        self.pool = HostExpertsPool(host_address=host_address, host_slots=host_slots, slot_bytes=slot_bytes,
                                    max_pairs=max_pairs, max_cols=hidden, max_rows=hidden, threads=config.threads,
                                    pinned=device.type == "cuda")
        if config.share is None:
            self.tuner: ShareTuner | None = ShareTuner.starting_at(DEFAULT_SHARE, levels=TUNER_LEVELS)
            self._level, self._denominator = self.tuner.level, TUNER_LEVELS  # the tuner rewrites the numerator
        else:
            self.tuner = None
            fixed = Fraction(config.share).limit_denominator(64)
            self._level, self._denominator = fixed.numerator, fixed.denominator
        self.share = torch.tensor([self._level, self._denominator], dtype=torch.int32, device=device)  # int32 [2]
        self.share_moves = 0  # times the tuner changed the share
        box = handoff.Mailbox.of(self.pool, device)
        cpu_pairs = torch.zeros(max_pairs, dtype=torch.int32, device=device)
        self.layers: dict[int, CpuShare] = {}
        self.agent = None
        try:
            copies = None
            if config.copy_engine:
                self.agent = start_copy_agent(host_address, host_slots, slot_bytes, min(COPY_SLOTS, max_pairs), device)
                copies = handoff.CopyBox.of(self.agent, device)
            for layer, binding in eligible.items():
                activate, limit = activations[layer]
                kind = self.pool.add_kind(binding.fused.up, binding.fused.down, limit)
                mismatch = activation_mismatch(self.pool, kind, activate, binding.fused.down.cols, device)
                if mismatch is not None:
                    log.info("CPU experts: layer %d: %s; its host-tier experts are read over the link", layer, mismatch)
                    continue
                experts = binding.plan.target.num_experts
                gpu_map = torch.empty(experts, dtype=torch.int32, device=device)
                copy_map = None if copies is None else torch.empty(experts, dtype=torch.int32, device=device)
                self.layers[layer] = CpuShare(box, kind, self.share, gpu_map, cpu_pairs, max_pairs, copies=copies,
                                              copy_map=copy_map)
            if not self.layers:
                raise HostExpertsUnavailable("no layer's activation is one the CPU experts compute (see the log)")
            self.pool.start()
        except BaseException:
            self.close()
            raise
        log.info("CPU experts: %d threads (%s kernels) take %d/%d of the host-tier experts of %d of %d layers%s; "
                 "the GPU's are %s", config.threads, self.pool.kernel, self._level, self._denominator,
                 len(self.layers), len(bindings), " (tuned while decoding)" if self.tuner is not None else "",
                 "copied to VRAM by the copy engine" if self.agent is not None else "read in place")

    @property
    def share_now(self) -> float:
        """The share the steps use now."""
        return self._level / self._denominator

    def observe_step(self, seconds: float) -> None:
        """A decode step that computed through the handoff took `seconds` (wall, its results
        read back): the tuner's input. The next step reads the share it sets (a copy queued on
        the step's stream, before the next replay)."""
        if self.tuner is None:
            return
        level = self.tuner.observe(seconds)
        if level is not None and level != self._level:
            self.share[0] = level  # a fill on the current stream: no host sync
            self._level = level
            self.share_moves += 1
            log.debug("CPU experts: share %d/%d", level, self._denominator)

    def close(self) -> None:
        self.pool.close()
        if self.agent is not None:
            self.agent.close()


def start_copy_agent(host_address: int, host_slots: int, slot_bytes: int, max_copies: int, device: torch.device):
    """A started CopyAgent over the host tier, checked on one copy (host slot 0 into scratch slot
    0, its bytes compared): a copy engine that cannot be driven from here fails now, not in a step."""
    from inference.kernels.copy_agent import CopyAgent

    agent = CopyAgent(host_address=host_address, host_slots=host_slots, slot_bytes=slot_bytes,
                      max_copies=max_copies, device=device)
    try:
        agent.start()
        agent.run([0])
        probe = min(slot_bytes, 1 << 16)
        expected = torch.frombuffer((ctypes.c_uint8 * probe).from_address(host_address), dtype=torch.uint8)
        if not torch.equal(agent.scratch[:probe].cpu(), expected):
            raise HostExpertsUnavailable("copy agent: the self-check's copy differs from the host tier's bytes")
    except BaseException:
        agent.close()
        raise
    return agent


def pair_forward_shared(cpu: CpuShare, gemv, activate, x: torch.Tensor, experts: torch.Tensor,
                        slot_map: torch.Tensor, host_first: int, top_k: int, misses: torch.Tensor | None
                        ) -> torch.Tensor:
    """[P, H] down outputs of every pair (before the combine): `gemv(x, map, per_pair, first,
    out=None, scratch=False)` runs the GPU's GEMVs of one projection (first: gate/up, which counts
    misses) over the pairs whose slot in `map` is not -2 (into `out` when given; with `scratch`,
    map's ids name the copy agent's scratch slots, HostSlots from 1), `activate(gate_up)` the
    module's activation; the CPU's pairs' rows come from the pool, and with a copy agent
    (cpu.copies) the GPU's host-tier experts are read from their copies once they landed."""
    assert misses is not None, "the handoff reports a late CPU as a miss: a decode step's miss counter is needed"
    gpu_map = handoff.split_publish(cpu.box, x, experts, slot_map, host_first, cpu.share, kind=cpu.kind,
                                    top_k=top_k, gpu_map=cpu.gpu_map, cpu_pairs=cpu.cpu_pairs, copies=cpu.copies,
                                    copy_map=cpu.copy_map)
    gate_up = gemv(x, gpu_map, False, True)  # [P, 2I]: VRAM experts' (and in-place host ones') rows
    if cpu.copies is not None:  # the VRAM experts' GEMV ran while the copies moved
        handoff.copy_wait(cpu.copies, misses, cpu.timeout_ns)
        gemv(x, cpu.copy_map, False, True, out=gate_up, scratch=True)
    hidden = activate(gate_up).contiguous()  # [P, I]: the CPU's pairs' rows unused
    down = gemv(hidden, gpu_map, True, False)  # [P, H]
    if cpu.copies is not None:
        gemv(hidden, cpu.copy_map, True, False, out=down, scratch=True)
    handoff.collect(cpu.box, down, cpu.cpu_pairs, misses, cpu.timeout_ns)
    return down
