"""Write a GGUF (or a llama.cpp split set) whose tensor data is streamed, never held whole.

gguf-py's GGUFWriter writes the header, metadata and tensor infos (and names/sizes the split
shards, with split.* keys); tensor data then goes out chunk by chunk at the offsets those infos
promise: each tensor starts on the file's alignment and is zero padded to it, as GGUFWriter's
own write_tensors_to_file does. A caller can thus write experts totalling far more than RAM by
handing generators of per-expert arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import gguf
import numpy as np

from packformat.constants import ElementType, tensor_nbytes
from packtools.gguf.errors import GGUFError


class GGUFWriteError(GGUFError):
    """A streamed tensor produced a different number of bytes than its info promised."""


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its info now, its bytes later from `chunks`."""

    name: str
    shape: tuple[int, ...]  # numpy order, logical elements; the last dim is contiguous (ggml ne[0])
    element_type: ElementType
    # arrays whose raw bytes, concatenated in order, are the tensor's data (e.g. one per expert)
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.element_type, self.shape)


def write_gguf(
    path: Path | str,
    arch_name: str,
    add_metadata: Callable[[gguf.GGUFWriter], None],
    tensors: Sequence[TensorPlan],
    *,
    split_max_tensors: int | None = None,
) -> list[Path]:
    """Write `tensors` after the metadata `add_metadata` adds; returns the file(s) written.

    With split_max_tensors, llama.cpp's split layout: `<stem>-00001-of-0000N.gguf`, ...,
    each shard with split.no / split.count / split.tensors.count and its own tensor infos.
    """
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch_name, split_max_tensors=split_max_tensors or 0)
    add_metadata(writer)
    by_name = {}
    for plan in tensors:
        # tensor_dtype is only consulted for uint8 (byte shapes); our shapes are element shapes
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=plan.element_type)
        by_name[plan.name] = plan
    paths = writer.format_shard_names(path)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None and len(writer.fout) == len(writer.tensors) == len(paths)
        for fout, infos in zip(writer.fout, writer.tensors):
            writer.write_padding(fout, fout.tell())  # tensor data starts aligned
            for name in infos:
                _stream_tensor(fout, by_name[name])
                writer.write_padding(fout, by_name[name].nbytes)
        writer.close()
    except BaseException:
        writer.close()
        for written in paths:
            written.unlink(missing_ok=True)
        raise
    return paths


def _stream_tensor(fout, plan: TensorPlan) -> None:
    written = 0
    for chunk in plan.chunks():
        data = np.ascontiguousarray(chunk)
        written += data.nbytes
        if written > plan.nbytes:
            break  # never write past the space the tensor info reserved
        fout.write(memoryview(data).cast("B"))
    if written != plan.nbytes:
        raise GGUFWriteError(
            f"tensor {plan.name!r} ({plan.element_type.name}, shape {plan.shape}): chunks gave "
            f"{'at least ' if written > plan.nbytes else ''}{written} bytes, its info promises {plan.nbytes}"
        )
