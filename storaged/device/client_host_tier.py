"""Client side of the daemon's shared host tier: its memory file mapped read-only, and on CUDA
registered with the device so that kernels read host-tier objects in place over the link.

    tier = ClientHostTier(fd, slot_bytes, slot_count)    # fd: from the data plane's HOST_TIER
    address = tier.device_address(torch.device("cuda", 0))  # where kernels find host slot 0
    tier.slot_view(h, nbytes)                              # uint8 CPU view of host slot h

Which host slot holds which object is the arena's host map (ClientArena.host_map); like the slot
map it is read under the session's step fence. Imports torch only (never grpc).
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings

import torch

from storaged.device.errors import ArenaClosedError, ArenaMapError, SlotRangeError


class ClientHostTier:
    def __init__(self, fd: int, slot_bytes: int, slot_count: int):
        if slot_bytes <= 0 or slot_count <= 0:
            raise ArenaMapError(f"a host tier of {slot_count} slots of {slot_bytes} bytes cannot be mapped")
        self.slot_bytes = slot_bytes
        self.slot_count = slot_count
        nbytes = slot_bytes * slot_count
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise ArenaMapError(f"host tier descriptor {fd}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode) or info.st_size < nbytes:
            raise ArenaMapError(f"host tier descriptor {fd} is not a memory file of at least {nbytes} bytes "
                                f"(size {info.st_size})")
        try:
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ArenaMapError(f"cannot map the host tier read-only: {exc.strerror}") from None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            self._tensor: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)  # [nbytes], never written
        self._driver = None
        self._device: torch.device | None = None
        self._device_address: int | None = None

    def _live(self) -> torch.Tensor:
        if self._tensor is None:
            raise ArenaClosedError("client host tier is closed")
        return self._tensor

    def slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """uint8 [nbytes] CPU view of host slot `slot` (read-only use)."""
        nbytes = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= slot < self.slot_count or not 0 <= nbytes <= self.slot_bytes:
            raise SlotRangeError("client host tier", slot, self.slot_count, nbytes, self.slot_bytes)
        start = slot * self.slot_bytes  # byte offset of the slot in the tier
        return self._live()[start:start + nbytes]

    def device_address(self, device: torch.device) -> int:
        """The device address of host slot 0 on `device` (CUDA), registering the mapping (page-locked,
        read-only, mapped into the device's address space) on first use."""
        tensor = self._live()
        if self._device_address is None:
            from storaged.device.cuda_driver import DriverApi

            driver = DriverApi(device.index or 0)
            try:
                self._device_address = driver.register_mapped(tensor.data_ptr(), tensor.numel(), read_only=True)
            except BaseException:
                driver.close()
                raise
            self._driver, self._device = driver, device
        return self._device_address

    def close(self) -> None:
        """Wait for the device's queued work (it may read the tier), unregister, drop the mapping."""
        if self._tensor is None:
            return
        if self._driver is not None:
            try:
                torch.cuda.synchronize(self._device)
                self._driver.unregister(self._tensor.data_ptr())
            finally:
                self._driver.close()
                self._driver = None
        # Not mmap.close(): views from slot_view would dangle; the mapping goes with the last of them.
        self._tensor = None
        self._mmap = None
        self._device_address = None
