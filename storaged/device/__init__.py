"""storaged.device — where expert bytes live once read: the slot arena, the host tier, copies.

Server side
-----------
- `create_arena(kind, slot_count, slot_bytes, *, device=0, event_count=256) -> Arena`: kind
  "cpu" (`CpuArena`, a memfd sealed against writes through any descriptor but this process's
  mapping), "cuda" (`CudaArena`, one device tensor exported with CUDA IPC) or "auto".
  slot_bytes must be a multiple of 4096.
- `Arena.descriptor() -> ArenaDescriptor`: plain values to send in the Attach reply. On CUDA
  call it once per client session (each call is a fresh IPC export with its own refcount).
  `Arena.client_fd`: the memfd a CPU arena's clients map (sent over the data plane; None on
  CUDA). `Arena.host_view(slot, nbytes)`: a CPU slot's bytes without a copy (None on CUDA).
- `Arena.copy_in(slot, source, nbytes) -> CopyHandle`: source is an `AlignedBuffer` (staging
  buffer or host-tier slot), a uint8 CPU tensor or a writable memoryview. CPU: complete on
  return. CUDA: non-blocking on the arena's copy stream, followed by an interprocess event.
  `Arena.copy_out(slot, destination, nbytes)` is the reverse (CUDA: on a second stream, so
  both directions of the link work at once); copies into and out of one slot run in issue order. `Arena.slot_tensor(slot, nbytes)`
  views a slot in the server process; `synchronize()`, `close()`.
- `CopyHandle`: `await h.wait()` (event loop), `h.synchronize()` (any thread), `h.done`,
  `h.event_index` (None when already complete, else an index into
  `descriptor.event_handles`). Publish a slot either after `await h.wait()`, or at once with
  `h.event_index` for the client to wait on. Do not release or overwrite the copy's host
  buffer before the handle is done.
- `HostTier(slot_count, slot_bytes, *, pin)`: the host-RAM tier. `slot(n) -> AlignedBuffer` is
  an O_DIRECT read target; `copy_to_arena(n, arena, vram_slot, nbytes) -> CopyHandle` (H2D);
  `copy_from(n, source, nbytes)` (host memcpy from staging); `slot_tensor`, `close`.

Client side (storaged.device.client_arena; imports torch, never grpc)
---------------------------------------------------------------------
- `map_arena(descriptor, fd=None) -> ClientArena` (fd: a memfd arena's descriptor from the data
  plane); `ClientArena.slot_view(slot, nbytes) -> uint8 tensor` (read-only use; memfd views are
  mapped read-only, CUDA IPC views cannot be); `wait_event(index, stream=None)` (CUDA: the
  stream waits for that copy; memfd: no-op); `close()`.

Errors (storaged.device.errors): ArenaError, ArenaDescriptorError, SlotRangeError,
ArenaClosedError, ArenaMapError, CudaUnavailableError, EventIndexError, CopySizeError.
"""

from storaged.device.arena import Arena, CopyHandle, CpuArena
from storaged.device.client_arena import ClientArena, map_arena
from storaged.device.cuda_arena import CudaArena
from storaged.device.descriptor import KIND_CUDA_IPC, KIND_MEMFD, ArenaDescriptor
from storaged.device.errors import (ArenaClosedError, ArenaDescriptorError, ArenaError, ArenaMapError,
                                    CopySizeError, CudaUnavailableError, EventIndexError, SlotRangeError)
from storaged.device.factory import create_arena
from storaged.device.host_tier import HostTier

__all__ = [
    "Arena", "ArenaClosedError", "ArenaDescriptor", "ArenaDescriptorError", "ArenaError",
    "ArenaMapError", "ClientArena", "CopyHandle", "CopySizeError", "CpuArena", "CudaArena",
    "CudaUnavailableError", "EventIndexError", "HostTier", "KIND_CUDA_IPC", "KIND_MEMFD",
    "SlotRangeError", "create_arena", "map_arena",
]
