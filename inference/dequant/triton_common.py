"""Triton helpers shared by the dequant kernels. Importing this module imports triton.

Kernel contract (every type): program (i, r) dequantizes super-blocks i*BLOCKS .. +BLOCKS-1 of
row r (one expert's role); row r's bytes start at raw_ptr + r * raw_row_stride and its values
at out_ptr + r * out_row_stride. Kernels must be launched with enable_fp_fusion=False: gguf-py
rounds every product before the add/sub that follows, and a fused multiply-add would not.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_fp16_as_f32(ptr, mask):
    """Little-endian fp16 at byte pointers `ptr` (any alignment) -> exact float32."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_bytes(ptr, mask):
    """uint8 at byte pointers `ptr`, widened to int32 so shifts and sums cannot wrap."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def row_block_bases(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride,
                    TYPE_SIZE: tl.constexpr, BLOCK_ELEMS: tl.constexpr, BLOCKS: tl.constexpr):
    """This program's blocks: (first byte [B] ptrs, first output [B] ptrs, valid [B] mask)."""
    row = tl.program_id(1).to(tl.int64)
    block = (tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)).to(tl.int64)  # [B] block in row
    valid = block < blocks_per_row  # [B]
    raw_base = raw_ptr + row * raw_row_stride + block * TYPE_SIZE  # [B] byte ptrs
    out_base = out_ptr + row * out_row_stride + block * BLOCK_ELEMS  # [B] element ptrs
    return raw_base, out_base, valid
