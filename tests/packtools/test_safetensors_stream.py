"""The streaming safetensors writer and header reader, checked against the safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from packtools.safetensors_stream import SafetensorsFormatError, StreamingSafetensorsWriter, read_header

TENSORS = {
    "a.weight": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "scalar": torch.tensor(2.5, dtype=torch.float32),
    "empty": torch.zeros(0, 4, dtype=torch.float16),
    "ids": torch.arange(12, dtype=torch.int64).reshape(4, 3),
    "mask": torch.tensor([True, False, True]),
    "big": torch.randn(64, 33, generator=torch.Generator().manual_seed(1)),
}


def entries(tensors):
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def test_round_trip_through_safe_open(tmp_path):
    path = tmp_path / "x.safetensors"
    with StreamingSafetensorsWriter(path, entries(TENSORS), metadata={"format": "pt"}) as writer:
        for name, tensor in TENSORS.items():
            writer.write(name, tensor)
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == set(TENSORS) and f.metadata() == {"format": "pt"}
        for name, tensor in TENSORS.items():
            loaded = f.get_tensor(name)
            assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor), name
    header = read_header(path)
    assert header.data_start % 8 == 0 and header.metadata == {"format": "pt"}
    assert path.stat().st_size == header.data_start + max(e.end for e in header.tensors.values())


def test_parts_bytes_and_numpy_are_accepted(tmp_path):
    big = TENSORS["big"]
    path = tmp_path / "parts.safetensors"
    with StreamingSafetensorsWriter(path, [("big", "F32", (64, 33)), ("raw", torch.uint8, (5,))]) as writer:
        for rows in big.split(10):  # [<=10, 33] row blocks of one tensor
            writer.write_part("big", rows)
        writer.write("raw", bytes(range(5)))
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("big"), big)
        assert f.get_tensor("raw").tolist() == [0, 1, 2, 3, 4]


def test_header_reader_agrees_with_the_library(tmp_path):
    path = tmp_path / "lib.safetensors"
    save_file({"w": TENSORS["big"], "b": TENSORS["a.weight"]}, path)
    header = read_header(path)
    blob = path.read_bytes()
    for name, expected in (("w", TENSORS["big"]), ("b", TENSORS["a.weight"])):
        entry = header.tensors[name]
        data = blob[header.data_start + entry.begin : header.data_start + entry.end]
        assert data == expected.contiguous().view(torch.uint8).numpy().tobytes()


def _writer(tmp_path):
    return StreamingSafetensorsWriter(tmp_path / "bad.safetensors", [("a", torch.float32, (2, 3)), ("b", "F16", (4,))])


@pytest.mark.parametrize(
    "action, words",
    [
        (lambda w: w.write("b", torch.zeros(4, dtype=torch.float16)), "declared is 'a'"),
        (lambda w: w.write("a", torch.zeros(3, 2)), "shape"),
        (lambda w: w.write("a", torch.zeros(2, 3, dtype=torch.float64)), "float64"),
        (lambda w: w.write("a", b"\x00" * 23), "23 bytes"),
        (lambda w: (w.write_part("a", b"\x00" * 8), w.write("a", b"\x00" * 24)), "already written"),
        (lambda w: w.write_part("a", b"\x00" * 25), "25 bytes"),
        (lambda w: (w.write("a", torch.zeros(2, 3)), w.write("b", torch.zeros(4, dtype=torch.float16)),
                    w.write("c", b"")), "every declared tensor is done"),
    ],
)
def test_wrong_order_size_or_type_is_rejected(tmp_path, action, words):
    writer = _writer(tmp_path)
    with pytest.raises(SafetensorsFormatError, match=words):
        action(writer)
    writer.abort()
    assert not list(tmp_path.iterdir())


def test_incomplete_file_is_never_published(tmp_path):
    writer = _writer(tmp_path)
    writer.write("a", torch.zeros(2, 3))
    with pytest.raises(SafetensorsFormatError, match="next was 'b'"):
        writer.close()
    assert not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError):
        with _writer(tmp_path) as w:
            w.write("a", torch.zeros(2, 3))
            raise RuntimeError("caller failed")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("declared", [
    [("a", "F32", (1,)), ("a", "F32", (1,))],
    [("__metadata__", "F32", (1,))],
    [("a", "Q4_K", (32,))],
])
def test_bad_declarations_are_rejected(tmp_path, declared):
    with pytest.raises(SafetensorsFormatError):
        StreamingSafetensorsWriter(tmp_path / "d.safetensors", declared)


@pytest.mark.parametrize("blob, words", [(b"\x01\x00", "shorter"), (b"\x40\x00\x00\x00\x00\x00\x00\x00{}", "truncated"),
                                         (b"\x02\x00\x00\x00\x00\x00\x00\x00{x", "not JSON")])
def test_corrupt_headers_are_rejected(tmp_path, blob, words):
    (tmp_path / "c.safetensors").write_bytes(blob)
    with pytest.raises(SafetensorsFormatError, match=words):
        read_header(tmp_path / "c.safetensors")
