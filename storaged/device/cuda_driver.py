"""The few CUDA driver calls storaged's copy path makes per object, bound with ctypes.

Why not torch: an Acquire that promotes four experts from the host tier makes four copies,
four demotions and their event records, and through torch each costs 20–100 µs of Python and
dispatcher work on the event loop (tensor views, stream guards, pinned-memory lookups). Through
the driver each is one call of a few µs. torch still owns the allocation, the streams and the
interprocess events; this module only issues work on them, so handles are torch's
(`Stream.cuda_stream`, `Event.cuda_event`: a cudaStream_t is a CUstream, a cudaEvent_t a CUevent).

Driver calls act on the calling thread's current context; `DriverApi` makes the device's
primary context (the one torch uses) current once per thread before its first call.
"""

from __future__ import annotations

import ctypes
import threading

from storaged.device.errors import CudaUnavailableError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2
CU_MEMHOSTREGISTER_READ_ONLY = 0x8  # memory this process may only read (a sealed file mapped read-only)

_c_ptr = ctypes.c_void_p
_c_size = ctypes.c_size_t
_c_uint = ctypes.c_uint
_c_int = ctypes.c_int

# name in libcuda → argument types; each returns a CUresult (int)
_SIGNATURES = {
    "cuInit": (_c_uint,),
    "cuDeviceGet": (ctypes.POINTER(_c_int), _c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_c_ptr), _c_int),
    "cuDevicePrimaryCtxRelease_v2": (_c_int,),
    "cuCtxSetCurrent": (_c_ptr,),
    "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, _c_ptr, _c_size, _c_ptr),
    "cuMemcpyDtoHAsync_v2": (_c_ptr, ctypes.c_uint64, _c_size, _c_ptr),
    "cuEventCreate": (ctypes.POINTER(_c_ptr), _c_uint),
    "cuEventDestroy_v2": (_c_ptr,),
    "cuEventRecord": (_c_ptr, _c_ptr),
    "cuEventQuery": (_c_ptr,),
    "cuEventSynchronize": (_c_ptr,),
    "cuStreamWaitEvent": (_c_ptr, _c_ptr, _c_uint),
    "cuGetErrorName": (_c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuMemHostRegister_v2": (_c_ptr, _c_size, _c_uint),
    "cuMemHostUnregister": (_c_ptr,),
    "cuMemHostGetDevicePointer_v2": (ctypes.POINTER(ctypes.c_uint64), _c_ptr, _c_uint),
}


class CudaDriverError(CudaUnavailableError):
    """A driver call failed; the message names the call and the CUresult."""


def _load() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaUnavailableError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = _c_int
    return lib


class DriverApi:
    """Copies, event records and stream waits on one device's primary context."""

    def __init__(self, device_index: int):
        self._lib = lib = _load()
        self._check("cuInit", lib.cuInit(0))
        device = _c_int()
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(device), device_index))
        context = _c_ptr()
        self._check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        self._device = device.value
        self._context = context.value
        self._local = threading.local()

    def _check(self, call: str, result: int) -> None:
        if result != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaDriverError(f"{call} failed: CUresult {result} ({(name.value or b'?').decode()})")

    def _current(self) -> ctypes.CDLL:
        if getattr(self._local, "context", None) != self._context:
            self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(self._context))
            self._local.context = self._context
        return self._lib

    def copy_to_device(self, device_address: int, host_address: int, nbytes: int, stream: int) -> None:
        """Queue nbytes host → device on `stream` (asynchronous when the host memory is pinned)."""
        self._check("cuMemcpyHtoDAsync", self._current().cuMemcpyHtoDAsync_v2(device_address, host_address,
                                                                             nbytes, stream))

    def copy_to_host(self, host_address: int, device_address: int, nbytes: int, stream: int) -> None:
        """Queue nbytes device → host on `stream`."""
        self._check("cuMemcpyDtoHAsync", self._current().cuMemcpyDtoHAsync_v2(host_address, device_address,
                                                                             nbytes, stream))

    def record(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self._current().cuEventRecord(event, stream))

    def wait(self, stream: int, event: int) -> None:
        """`stream` runs nothing queued after this until `event`'s recorded work completed."""
        self._check("cuStreamWaitEvent", self._current().cuStreamWaitEvent(stream, event, 0))

    def register_mapped(self, host_address: int, nbytes: int, *, read_only: bool = False) -> int:
        """Pin [host_address, +nbytes) (page-aligned; e.g. a shared mapping another process pins
        too) and map it into the device's address space; → the device address kernels read it at.
        read_only: the mapping is read-only (the device may then only read it)."""
        lib = self._current()
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        if read_only:
            flags |= CU_MEMHOSTREGISTER_READ_ONLY
        self._check("cuMemHostRegister", lib.cuMemHostRegister_v2(host_address, nbytes, flags))
        device_address = ctypes.c_uint64()
        result = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device_address), host_address, 0)
        if result != CUDA_SUCCESS:
            lib.cuMemHostUnregister(host_address)
            self._check("cuMemHostGetDevicePointer", result)
        return device_address.value

    def unregister(self, host_address: int) -> None:
        """Undo register_mapped; only once no queued kernel reads the memory any more."""
        self._check("cuMemHostUnregister", self._current().cuMemHostUnregister(host_address))

    def create_event(self) -> DriverEvent:
        """A timing-free event whose synchronize sleeps rather than spins."""
        handle = _c_ptr()
        self._check("cuEventCreate", self._current().cuEventCreate(
            ctypes.byref(handle), CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC))
        return DriverEvent(self, handle.value)

    def close(self) -> None:
        if self._context is not None:
            self._lib.cuDevicePrimaryCtxRelease_v2(self._device)
            self._context = None


class DriverEvent:
    """A CUevent with torch.cuda.Event's query/synchronize, for copies no client waits on."""

    def __init__(self, api: DriverApi, handle: int):
        self._api = api
        self.cuda_event = handle

    def query(self) -> bool:
        result = self._api._current().cuEventQuery(self.cuda_event)
        if result == CUDA_ERROR_NOT_READY:
            return False
        self._api._check("cuEventQuery", result)
        return True

    def synchronize(self) -> None:
        self._api._check("cuEventSynchronize", self._api._current().cuEventSynchronize(self.cuda_event))

    def destroy(self) -> None:
        if self.cuda_event is not None:
            self._api._current().cuEventDestroy_v2(self.cuda_event)
            self.cuda_event = None
