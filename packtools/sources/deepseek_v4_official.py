"""DeepSeek-V4 in the layout DeepSeek publishes, as a CheckpointSource.

Everything HFSource does, plus the FP8 dense weights: each float8_e4m3fn `X.weight` comes with
`X.scale` (UE8M0, one per 128x128 block); the pair becomes one dense tensor under the runtime
name of `X.weight`, dequantized exactly (packtools.sources.dsv4_formats: bfloat16 when the
scales allow, which the published scales do, else float32). Routed experts (packed FP4 +
UE8M0 scales) are copied verbatim by HFSource's ExpertIndex through the deepseek_v4 ArchSpec's
`block_scaled`; MTP tensors (`mtp.*`) are skipped as transformers skips them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from packtools.arch.hf_experts import LocatedTensor
from packtools.sources.base import DenseTensor
from packtools.sources.dsv4_formats import DeepseekV4FormatError, check_fp8_pair, dequantize_fp8_blocks, \
    fp8_dequantized_dtype
from packtools.sources.hf import CONFIG_FILE, HFSource

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = frozenset({"F8_E8M0", "U8"})  # UE8M0, as float8_e8m0fnu or its raw bytes
WEIGHT_SUFFIX, SCALE_SUFFIX = ".weight", ".scale"


def is_official_layout(path: Path | str) -> bool:
    """A deepseek_v4 directory whose config carries DeepSeek's FP8 quantization_config (the
    published checkpoint; transformers' save_pretrained writes neither it nor FP8 tensors)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text())
    quantization = config.get("quantization_config") or {}
    return config.get("model_type") == "deepseek_v4" and quantization.get("quant_method") == "fp8"


@dataclasses.dataclass(frozen=True)
class FP8Pair:
    weight: str  # checkpoint name of the float8_e4m3fn data
    scale: str  # checkpoint name of its UE8M0 block scales
    dtype: torch.dtype  # what the dequantized tensor is stored as (exact)


def pair_fp8_dense(located: dict[str, LocatedTensor], is_expert: Callable[[str], bool]) -> dict[str, FP8Pair]:
    """weight name -> FP8Pair for every dense FP8 weight; refuses orphans on either side."""
    pairs: dict[str, FP8Pair] = {}
    for name, loc in located.items():
        if is_expert(name):
            continue
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX) + WEIGHT_SUFFIX
            if weight not in located or located[weight].entry.dtype != FP8_DTYPE:
                what = "is missing" if weight not in located else f"is {located[weight].entry.dtype}, not {FP8_DTYPE}"
                raise DeepseekV4FormatError(f"scale tensor {name!r} scales nothing: {weight!r} {what}")
            if loc.entry.dtype not in SCALE_DTYPES:
                raise DeepseekV4FormatError(f"scale tensor {name!r} is {loc.entry.dtype}; UE8M0 scales are "
                                            f"one of {sorted(SCALE_DTYPES)}")
            check_fp8_pair(weight, located[weight].entry.shape, loc.entry.shape)
        elif loc.entry.dtype == FP8_DTYPE:
            scale = name.removesuffix(WEIGHT_SUFFIX) + SCALE_SUFFIX
            if not name.endswith(WEIGHT_SUFFIX) or scale not in located:
                raise DeepseekV4FormatError(f"FP8 tensor {name!r} has no block scale tensor {scale!r}")
            pairs[name] = FP8Pair(name, scale, torch.bfloat16)  # dtype fixed once the scales are read
    return pairs


class DeepseekV4OfficialSource(HFSource):
    """HFSource over DeepSeek's published DeepSeek-V4 layout (FP8 dense, FP4 experts)."""

    def _dense_tensor_names(self, kept: dict[str, LocatedTensor]) -> list[str]:
        """Dense weights without their FP8 block scales; pairs each FP8 weight with its scale."""
        pairs = pair_fp8_dense(kept, lambda name: name in self._experts.expert_tensor_names)
        # the scales are tiny ([out/128, in/128] bytes): read now to fix each tensor's exact dtype
        self._fp8 = {name: dataclasses.replace(pair, dtype=fp8_dequantized_dtype(
            pair.scale, HFSource._get_tensor(self, pair.scale))) for name, pair in pairs.items()}
        scales = {pair.scale for pair in self._fp8.values()}
        return [n for n in kept if n not in self._experts.expert_tensor_names and n not in scales]

    def _get_tensor(self, name: str) -> torch.Tensor:
        pair = self._fp8.get(name)
        if pair is None:
            return super()._get_tensor(name)
        weight, scale = super()._get_tensor(pair.weight), super()._get_tensor(pair.scale)
        return dequantize_fp8_blocks(pair.weight, weight, scale, pair.dtype)  # [out, in]

    def dense_tensors(self) -> Iterator[DenseTensor]:
        dtype_of = {plan.runtime_name: self._fp8[plan.sources[0]].dtype
                    for plan in self._dense_plans if plan.sources[0] in self._fp8}
        for tensor in super().dense_tensors():
            yield dataclasses.replace(tensor, dtype=dtype_of.get(tensor.name, tensor.dtype))

    def identity(self) -> dict:
        return {**super().identity(), "layout": "deepseek_v4 official (FP8 dense dequantized, FP4 experts verbatim)"}
