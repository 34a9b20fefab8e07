"""The copy agent (copy_agent.c): host-tier experts copied to VRAM by the copy engine on the
device's demand, beside the CPU experts' pool.

The decode step reads the GPU's host-tier experts in place through the SMs (36-41 GB/s on the
H100/H200 hosts), which leaves the copy engine (~52 GB/s) idle: a captured graph cannot aim a copy
at experts it picks on the device. This host thread does: the device posts a layer's host slots
into the agent's mailbox (inference.kernels.handoff.split_publish), the agent copies each object
into a VRAM scratch slot on a stream of its own and writes the job's mark into device memory after
the copies; the device waits for the mark (handoff.copy_wait) and the GEMVs of those experts read
the scratch.

    agent = CopyAgent(host_address=..., host_slots=..., slot_bytes=..., max_copies=16,
                      device=torch.device("cuda"))
    agent.start()
    agent.run([5, 2])           # host-side job (tests, the start's self-check): scratch slots 0, 1

Without CUDA (device "cpu": tests, the triton interpreter) the scratch and the mark are host
tensors and the agent copies with memcpy, under the same protocol.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from inference.kernels.host_experts import HostExpertsUnavailable, compile_library, default_cache_dir

SOURCE = Path(__file__).with_name("copy_agent.c")
W_TICKET, W_COUNT, W_SLOTS = 0, 16, 24
MARK_MASK, MARK_REFUSED = 0x3FFFFFFF, 0x40000000


def build_library(cache_dir: Path | None = None) -> ctypes.CDLL:
    library = compile_library(SOURCE, ["-O2", "-pthread"], cache_dir or default_cache_dir())
    lib = ctypes.CDLL(str(library))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.copy_agent_create.restype = p
    lib.copy_agent_create.argtypes = [p, i64, p, i64, i64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, p,
                                      ctypes.POINTER(ctypes.c_int)]
    lib.copy_agent_start.restype = ctypes.c_int
    lib.copy_agent_start.argtypes = [p]
    lib.copy_agent_stats.restype = None
    lib.copy_agent_stats.argtypes = [p, p]
    lib.copy_agent_destroy.restype = None
    lib.copy_agent_destroy.argtypes = [p]
    return lib


@dataclasses.dataclass(frozen=True)
class CopyAgentStats:
    jobs: int  # jobs whose copies were issued
    refused: int  # jobs refused (malformed, or a CUDA call failed): the device counted a miss
    copies: int  # objects copied
    cuda_error: int  # the first failing CUDA call's error code (0: none)


class CopyAgent:
    """The agent's thread, its mailbox (page-locked where CUDA is used), the scratch slots and the
    mark, all for one decoder's host tier."""

    def __init__(self, *, host_address: int, host_slots: int, slot_bytes: int, max_copies: int,
                 device: torch.device, cache_dir: Path | None = None):
        if max_copies < 1 or host_slots < 1 or slot_bytes < 1:
            raise HostExpertsUnavailable(f"copy agent: max_copies {max_copies}, host_slots {host_slots}, "
                                         f"slot_bytes {slot_bytes}: each must be positive")
        self.lib = build_library(cache_dir)
        self.max_copies, self.slot_bytes, self.device = max_copies, slot_bytes, device
        cuda = device.type == "cuda"
        words = -(-(W_SLOTS + max_copies) // 8) * 8
        self.words = torch.zeros(words, dtype=torch.int64, pin_memory=cuda)  # the mailbox, int64 words
        self.scratch = torch.zeros(max_copies * slot_bytes, dtype=torch.uint8, device=device)  # [slots * bytes]
        self.mark = torch.full((1,), -1, dtype=torch.int32, device=device)  # int32 [1]: no ticket's mark yet
        self.stream = torch.cuda.Stream(device) if cuda else None  # the copies' own stream: not the step's
        error = ctypes.c_int(0)
        self._agent = self.lib.copy_agent_create(
            self.words.data_ptr(), max_copies, host_address, host_slots, slot_bytes, self.scratch.data_ptr(),
            self.mark.data_ptr(), (torch.cuda.current_device() if device.index is None else device.index) if cuda else -1,
            self.stream.cuda_stream if cuda else None, ctypes.byref(error))
        if not self._agent:
            raise HostExpertsUnavailable(f"copy agent: could not start (code {error.value}: "
                                         + ("libcuda.so.1 or its symbols missing)" if error.value in (-1, -2)
                                            else "a CUDA call failed or an argument was refused)"))
        self.started = False

    def start(self) -> None:
        if self.lib.copy_agent_start(self._agent) != 0:
            raise HostExpertsUnavailable("copy agent: its thread did not start")
        self.started = True

    def stats(self) -> CopyAgentStats:
        out = (ctypes.c_int64 * 4)()
        self.lib.copy_agent_stats(self._agent, ctypes.addressof(out))
        return CopyAgentStats(*out)

    def run(self, slots: Sequence[int], timeout: float = 10.0) -> None:
        """One job from the host (tests, the start's self-check): host slot slots[i] into scratch
        slot i; returns once the mark says the copies landed."""
        assert self.started and len(slots) <= self.max_copies
        words = self.words
        words[W_SLOTS:W_SLOTS + len(slots)] = torch.tensor(list(slots), dtype=torch.int64)
        words[W_COUNT] = len(slots)
        ticket = int(words[W_TICKET]) + 1
        words[W_TICKET] = ticket  # after the inputs: a plain store, ordered on x86
        done, refused = ticket & MARK_MASK, (ticket & MARK_MASK) | MARK_REFUSED
        deadline = time.monotonic() + timeout
        while (mark := int(self.mark.item())) not in (done, refused):
            if time.monotonic() > deadline:
                raise HostExpertsUnavailable(f"copy agent: job {ticket} not done in {timeout} s "
                                             f"(CUDA error {self.stats().cuda_error})")
            time.sleep(0)
        if mark == refused:
            raise HostExpertsUnavailable(f"copy agent: job {ticket} refused (slots {list(slots)} outside the "
                                         f"host tier or more than {self.max_copies}; CUDA error "
                                         f"{self.stats().cuda_error})")

    def close(self) -> None:
        """Stop the thread (the device must not post jobs any more)."""
        if getattr(self, "_agent", None):  # None too when __init__ failed before it
            if self.stream is not None:
                self.stream.synchronize()
            self.lib.copy_agent_destroy(self._agent)
            self._agent = None

    def __del__(self) -> None:
        self.close()
