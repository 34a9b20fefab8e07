"""Opening GGUF files: magic, bounds and type checks, and llama.cpp split sets.

gguf-py's GGUFReader does the parsing; a subclass checks every read against the file size and
every tensor's type and byte range before gguf-py builds its views, so a bad file fails with a
typed error naming the tensor and offset instead of a numpy reshape error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import gguf
import numpy as np

from packtools.gguf.errors import (
    GGUFFormatError,
    GGUFMagicError,
    GGUFTruncatedError,
    MissingShardError,
    UnsupportedTensorTypeError,
)

# llama.cpp's split naming (gguf-py SHARD_NAME_FORMAT "{:s}-{:05d}-of-{:05d}.gguf")
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
GGUF_MAGIC_BYTES = b"GGUF"


class _CheckedReader(gguf.GGUFReader):
    def __init__(self, path: Path):
        self._path = path
        super().__init__(path)

    def _get(self, offset, dtype, count=1, override_order=None):
        needed = int(offset) + np.dtype(dtype).itemsize * int(count)
        if needed > len(self.data):
            raise GGUFTruncatedError(
                self._path, "metadata", offset=int(offset), needed=needed, file_size=len(self.data)
            )
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs, fields):
        for field in fields:
            _, name_data, _, dims, raw_type, relative_offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            start = int(start_offs) + int(relative_offset[0])
            try:
                ggml_type = gguf.GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise UnsupportedTensorTypeError(
                    self._path, name, f"id {int(raw_type[0])}", "not a GGML type gguf-py knows", offset=start
                ) from None
            block_elements, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            row = int(dims[0]) if len(dims) else 1
            if row % block_elements:
                message = f"tensor {name!r}: row of {row} elements is not whole {ggml_type.name} blocks"
                raise GGUFFormatError(self._path, message, offset=start)
            end = start + math.prod(int(d) for d in dims) // block_elements * type_size
            if end > len(self.data):
                raise GGUFTruncatedError(
                    self._path, f"tensor {name!r} data", offset=start, needed=end, file_size=len(self.data)
                )
        super()._build_tensors(start_offs, fields)


def open_reader(path: Path) -> gguf.GGUFReader:
    """A GGUFReader over `path`, or a typed error saying what is wrong with the file."""
    with open(path, "rb") as handle:
        magic = handle.read(len(GGUF_MAGIC_BYTES))
    if magic != GGUF_MAGIC_BYTES:
        if len(magic) < len(GGUF_MAGIC_BYTES) and GGUF_MAGIC_BYTES.startswith(magic):
            raise GGUFTruncatedError(path, "magic", offset=0, needed=len(GGUF_MAGIC_BYTES), file_size=len(magic))
        raise GGUFMagicError(path, magic)
    try:
        return _CheckedReader(path)
    except (ValueError, KeyError, IndexError, OverflowError) as exc:  # gguf-py's own complaints
        raise GGUFFormatError(path, f"gguf-py cannot parse it: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Shard:
    path: Path
    reader: gguf.GGUFReader
    size: int


def _split_field(reader: gguf.GGUFReader, key: str, default: int) -> int:
    field = reader.get_field(key)
    return int(field.contents()) if field is not None else default


def open_shards(path: Path) -> list[Shard]:
    """The file at `path`, or every shard of the split set whose first shard it is."""
    first = open_reader(path)
    count = _split_field(first, gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 1)
    shards = [Shard(path, first, path.stat().st_size)]
    if count <= 1:
        return shards
    match = SPLIT_NAME.match(path.name)
    if match is None:
        raise MissingShardError(path, f"split.count is {count} but the name is not <stem>-00001-of-{count:05d}.gguf, "
                                      "so the other shards cannot be found")
    number = _split_field(first, gguf.Keys.Split.LLM_KV_SPLIT_NO, 0)
    if number != 0:
        raise MissingShardError(path, f"this is shard {number + 1} of {count}; open the first shard")
    for index in range(2, count + 1):
        shard_path = path.with_name(f"{match['stem']}-{index:05d}-of-{count:05d}.gguf")
        if not shard_path.is_file():
            raise MissingShardError(shard_path, f"shard {index} of {count} is missing")
        reader = open_reader(shard_path)
        got = (
            _split_field(reader, gguf.Keys.Split.LLM_KV_SPLIT_NO, -1),
            _split_field(reader, gguf.Keys.Split.LLM_KV_SPLIT_COUNT, -1),
        )
        if got != (index - 1, count):
            raise MissingShardError(shard_path, f"split.no/split.count are {got}, expected {(index - 1, count)}")
        shards.append(Shard(shard_path, reader, shard_path.stat().st_size))
    expected = _split_field(first, gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, -1)
    total = sum(len(s.reader.tensors) for s in shards)
    if expected != total:
        raise GGUFFormatError(path, f"split.tensors.count is {expected} but the {count} shards hold {total} tensors")
    return shards


@dataclasses.dataclass(frozen=True)
class TensorLocation:
    """One tensor of a (possibly split) GGUF: where its bytes are and what they are."""

    shard: Shard
    tensor: gguf.ReaderTensor

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def element_type(self) -> gguf.GGMLQuantizationType:
        return self.tensor.tensor_type

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order, logical elements (ggml's ne reversed)."""
        return tuple(int(d) for d in reversed(self.tensor.shape.tolist()))

    @property
    def offset(self) -> int:
        return int(self.tensor.data_offset)

    @property
    def nbytes(self) -> int:
        return int(self.tensor.n_bytes)


def index_tensors(shards: list[Shard]) -> dict[str, TensorLocation]:
    located: dict[str, TensorLocation] = {}
    for shard in shards:
        for tensor in shard.reader.tensors:
            if tensor.name in located:
                other = located[tensor.name].shard.path.name
                raise GGUFFormatError(shard.path, f"tensor {tensor.name!r} is also in {other}")
            located[tensor.name] = TensorLocation(shard, tensor)
    return located
