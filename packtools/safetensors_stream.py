"""Write safetensors files tensor by tensor, and read their headers without loading data.

The safetensors layout is: u64 little-endian header length N | N bytes of JSON header (space
padded to 8 bytes) | tensor bytes. The header holds every tensor's byte range, so a writer that
knows all names, dtypes and shapes up front can emit the header first and then stream tensors
in order, never holding more than one tensor in memory. Files are written under a temporary
name and renamed on close, so a partial file never carries the final name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

HEADER_LENGTH = struct.Struct("<Q")
HEADER_ALIGNMENT = 8  # data section starts 8-byte aligned, as the safetensors library writes it
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# safetensors dtype name -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),  # UE8M0 block scales (DeepSeek-V4 checkpoints)
}
# "F4" (torch.float4_e2m1fn_x2, two values a byte) has no whole bytes per element, so it is not
# here: only routed expert data uses it, and those are copied as byte ranges (arch.hf_experts).
_NAME_OF_TORCH_DTYPE = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}


class SafetensorsFormatError(ValueError):
    """A safetensors file or a write request that breaks the format."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """The safetensors name of a torch dtype (or a name, validated)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise SafetensorsFormatError(f"unsupported safetensors dtype {dtype!r}")
        return dtype
    try:
        return _NAME_OF_TORCH_DTYPE[dtype]
    except KeyError:
        raise SafetensorsFormatError(f"torch dtype {dtype} has no safetensors name here") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, as safetensors stores them (no conversion)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    raw: bytes  # the JSON header bytes exactly as stored (padding included)
    data_start: int  # absolute file offset of the data section
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path | str) -> SafetensorsHeader:
    """Parse a safetensors header; reads only the header bytes."""
    path = Path(path)
    with open(path, "rb") as f:
        prefix = f.read(HEADER_LENGTH.size)
        if len(prefix) != HEADER_LENGTH.size:
            raise SafetensorsFormatError(f"{path}: shorter than the 8-byte header length")
        (length,) = HEADER_LENGTH.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            raise SafetensorsFormatError(f"{path}: header length {length} exceeds {MAX_HEADER_BYTES}")
        raw = f.read(length)
    if len(raw) != length:
        raise SafetensorsFormatError(f"{path}: header truncated at {len(raw)} of {length} bytes")
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"{path}: header is not JSON: {exc}") from None
    metadata = parsed.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in parsed.items():
        begin, end = info["data_offsets"]
        tensors[name] = TensorEntry(info["dtype"], tuple(info["shape"]), begin, end)
    return SafetensorsHeader(raw, HEADER_LENGTH.size + length, tensors, metadata)


class StreamingSafetensorsWriter:
    """Writes the header for `entries` at once, then each tensor's bytes in declared order.

    `entries` are (name, dtype, shape) with dtype a torch dtype or a safetensors name.
    Use as a context manager, or call close() (publish) / abort() (discard) yourself.
    """

    def __init__(self, path: Path | str, entries: list[tuple[str, torch.dtype | str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._entries: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, nbytes
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in entries:
            if name in header or name == "__metadata__":
                raise SafetensorsFormatError(f"tensor name {name!r} declared twice or reserved")
            dname, shape = dtype_name(dtype), tuple(int(d) for d in shape)
            nbytes = math.prod(shape) * DTYPES[dname][1]
            header[name] = {"dtype": dname, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._entries.append((name, dname, shape, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
        self.total_bytes = HEADER_LENGTH.size + len(encoded) + offset
        self._next = 0
        self._part_bytes = 0  # bytes written so far into tensor #_next
        self._file = open(self._partial, "wb")
        self._file.write(HEADER_LENGTH.pack(len(encoded)) + encoded)

    def write(self, name: str, data: torch.Tensor | bytes | bytearray | memoryview | np.ndarray) -> None:
        """Write the whole of the next declared tensor."""
        payload, nbytes = self._payload(name, data, whole=True)
        if self._part_bytes or payload.nbytes != nbytes:
            raise SafetensorsFormatError(
                f"{self.path}: {name!r} has {payload.nbytes} bytes"
                + (f" after {self._part_bytes} already written" if self._part_bytes else "")
                + f", declared {nbytes}"
            )
        self._append(payload, nbytes)

    def write_part(self, name: str, data: torch.Tensor | bytes | bytearray | memoryview | np.ndarray) -> None:
        """Append bytes to the next declared tensor (for tensors too large to hold at once, such
        as a fused [E, ...] expert tensor written expert by expert); it completes at its size."""
        payload, nbytes = self._payload(name, data, whole=False)
        if self._part_bytes + payload.nbytes > nbytes:
            raise SafetensorsFormatError(
                f"{self.path}: {name!r} would get {self._part_bytes + payload.nbytes} bytes, declared {nbytes}"
            )
        self._append(payload, nbytes)

    def _payload(self, name: str, data, *, whole: bool) -> tuple[memoryview, int]:
        if self._file is None:
            raise SafetensorsFormatError(f"{self.path}: write of {name!r} after close")
        if self._next >= len(self._entries):
            raise SafetensorsFormatError(f"{self.path}: {name!r} written but every declared tensor is done")
        expected_name, dname, shape, nbytes = self._entries[self._next]
        if name != expected_name:
            raise SafetensorsFormatError(
                f"{self.path}: got {name!r} but tensor #{self._next} declared is {expected_name!r}"
            )
        if isinstance(data, torch.Tensor):
            if data.dtype != DTYPES[dname][0]:
                raise SafetensorsFormatError(f"{self.path}: {name!r} is {data.dtype}, declared {dname}")
            if whole and tuple(data.shape) != shape:
                raise SafetensorsFormatError(f"{self.path}: {name!r} has shape {tuple(data.shape)}, declared {shape}")
            return tensor_bytes(data), nbytes
        if isinstance(data, np.ndarray):
            return memoryview(np.ascontiguousarray(data)).cast("B"), nbytes
        return memoryview(data).cast("B"), nbytes

    def _append(self, payload: memoryview, nbytes: int) -> None:
        self._file.write(payload)
        self._part_bytes += payload.nbytes
        if self._part_bytes == nbytes:
            self._next += 1
            self._part_bytes = 0

    def close(self) -> None:
        """Publish the file under its final name; every declared tensor must have been written."""
        if self._file is None:
            return
        if self._next != len(self._entries):
            missing = self._entries[self._next][0]  # the first tensor not completely written
            self.abort()
            raise SafetensorsFormatError(
                f"{self.path}: closed after {self._next} of {len(self._entries)} tensors; next was {missing!r}"
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        """Discard the partial file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
