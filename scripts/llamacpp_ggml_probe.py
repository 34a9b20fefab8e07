"""Read named intermediate tensors out of a llama.cpp run through ggml's scheduler eval callback.

llama.cpp names its graph nodes "<name>-<layer>" (e.g. "lid_top_k-1", DeepSeek-V4's lightning-indexer
choice in layer 1). `llama_context_params.cb_eval` is asked about every node before the graph runs;
for a node it says yes to, it is called again once that node's data is computed. On the CPU backend
the data then lies in host memory. Only the wanted nodes are observed; for deepseek_v4-MXFP4-topk8
a run without the callback gave bit-identical logits (checked when the golden was made).

Needs the llama_cpp bindings (llama-cpp-python 0.3.36) importable: run it with _vendored_env.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64  # bytes
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_NUMPY_TYPES = {0: np.float32, 1: np.float16, 26: np.int32}  # enum ggml_type: F32, F16, I32


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of the vendored ggml (ggml/include/ggml.h, commit 0c1e570)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),  # elements per dimension, innermost first
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),  # byte strides, innermost first
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class UnsupportedTensorError(TypeError):
    pass


def tensor_to_numpy(tensor: GgmlTensor) -> np.ndarray:
    """A copy of a computed host tensor, numpy axes outermost first: ggml [ne0, ne1, ne2, ne3] -> [ne3, ne2, ne1, ne0]."""
    name = tensor.name.decode()
    if tensor.type not in GGML_NUMPY_TYPES or not tensor.data:
        raise UnsupportedTensorError(f"ggml tensor {name!r}: type {tensor.type} or no host data")
    dtype = np.dtype(GGML_NUMPY_TYPES[tensor.type])
    shape, strides = list(tensor.ne)[::-1], list(tensor.nb)[::-1]
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize  # bytes from first to last element
    raw = np.frombuffer((ctypes.c_char * span).from_address(tensor.data), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(raw.view(dtype), shape=shape, strides=strides).copy()


class EvalRecorder:
    """Copies every computed node whose name `wanted` accepts, in evaluation order, into `captured`."""

    def __init__(self, wanted: Callable[[str], bool]):
        import llama_cpp  # noqa: PLC0415  (the vendored bindings, only on the run step's path)

        self.wanted = wanted
        self.captured: list[tuple[str, np.ndarray]] = []
        # keep the ctypes thunk referenced for as long as llama.cpp may call it
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, tensor_pointer: int, ask: bool, _user_data: int) -> bool:
        tensor = ctypes.cast(tensor_pointer, ctypes.POINTER(GgmlTensor)).contents
        name = tensor.name.decode()
        if ask:
            return self.wanted(name)
        self.captured.append((name, tensor_to_numpy(tensor)))
        return True  # go on computing

    def take(self, name: str) -> list[np.ndarray]:
        """The captures of `name` since the last take, oldest first; removes them."""
        taken = [array for captured_name, array in self.captured if captured_name == name]
        self.captured = [item for item in self.captured if item[0] != name]
        return taken

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every llama_cpp.Llama created inside gets this callback: llama_cpp.Llama builds its context
        from llama_context_default_params(), so wrapping that leaves every other setting as the caller's."""
        import llama_cpp.llama_cpp as bindings  # noqa: PLC0415

        default_params = bindings.llama_context_default_params

        def params_with_callback():
            params = default_params()
            params.cb_eval = self.callback
            params.cb_eval_user_data = None
            return params

        bindings.llama_context_default_params = params_with_callback
        try:
            yield
        finally:
            bindings.llama_context_default_params = default_params
