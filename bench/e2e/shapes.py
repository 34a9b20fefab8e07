"""The model shapes the end-to-end benchmark runs, and how many layers of them fit disk and time.

A shape is everything of a synthetic model except its layer count; the count is chosen per run
from the free disk and the preparation time left (`plan_layers`), so the same code makes the
full-size models on the lent GPU machine and the tiny ones of the CPU smoke test.
"""

from __future__ import annotations

import dataclasses

from packformat import constants as C


class ShapeError(ValueError):
    """A shape or a layer plan that cannot be built (the message names the shape and the limit)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str  # transformers model_type written to the GGUF
    hidden: int
    experts: int  # routed experts per MoE layer
    top_k: int
    moe_intermediate: int
    expert_type: str  # GGUF element type of the routed experts
    dense_layers: int  # leading layers without routed experts (deepseek_v3's first_k_dense_replace)
    note: str = ""

    @property
    def element_type(self) -> C.ElementType:
        return C.ElementType[self.expert_type]

    @property
    def expert_bytes(self) -> int:
        """One expert's gate, up [I, H] and down [H, I] in the GGUF (unpadded)."""
        i, h = self.moe_intermediate, self.hidden
        return 2 * C.tensor_nbytes(self.element_type, (i, h)) + C.tensor_nbytes(self.element_type, (h, i))

    @property
    def padded_expert_bytes(self) -> int:
        """Upper bound of one pack object: roles start 256-aligned, the object is 4096-aligned."""
        return C.align_up(self.expert_bytes + 3 * C.ROLE_ALIGNMENT, C.ALIGNMENT)

    @property
    def bf16_expert_bytes(self) -> int:
        return 3 * self.moe_intermediate * self.hidden * 2

    def moe_layers(self, layers: int) -> int:
        return layers - self.dense_layers

    def synth_sizes(self, layers: int) -> dict:
        """Keyword sizes of packtools.synth.gguf_cli.synth_gguf_model."""
        return dict(hidden_size=self.hidden, num_experts=self.experts, top_k=self.top_k,
                    moe_intermediate_size=self.moe_intermediate, num_layers=layers)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"expert_bytes": self.expert_bytes}


QWEN3_30B_A3B_LIKE = ModelShape(
    "Qwen3-30B-A3B-like", "qwen3_moe", hidden=2048, experts=128, top_k=8, moe_intermediate=768,
    expert_type="Q4_K", dense_layers=0)
DEEPSEEK_V4_FLASH_LIKE = ModelShape(
    "DeepSeek-V4-Flash-like", "deepseek_v3", hidden=4096, experts=256, top_k=6, moe_intermediate=2048,
    expert_type="MXFP4", dense_layers=1,
    note="written as a deepseek_v3 GGUF (gguf-py 0.19 has no DeepSeek-V4 architecture): the routed "
         "experts have V4-Flash's shape and type; attention is the synthesizer's narrow MLA, one dense "
         "layer first")
FULL_SHAPES = {"qwen3": QWEN3_30B_A3B_LIKE, "deepseek": DEEPSEEK_V4_FLASH_LIKE}


def tiny(shape: ModelShape) -> ModelShape:
    """The CPU smoke-test version of a shape: hidden 256, 8 experts, the same arch and expert type."""
    return dataclasses.replace(shape, name=f"{shape.name} (tiny)", hidden=256, experts=8,
                               top_k=min(shape.top_k, 2), moe_intermediate=256)


TINY_SHAPES = {key: tiny(shape) for key, shape in FULL_SHAPES.items()}


def cpu_scale(shape: ModelShape) -> ModelShape:
    """A shape's routing (experts, top-k, arch, expert type) at hidden and expert widths of 256: what
    batching and the cache do with its routing, at a size a CPU runs in minutes."""
    return dataclasses.replace(shape, name=f"{shape.name} (CPU scale)", hidden=256, moe_intermediate=256)


CPU_SCALE_SHAPES = {key: cpu_scale(shape) for key, shape in FULL_SHAPES.items()}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    layers: int
    disk_bytes: int  # GGUF + pack (+ bf16 checkpoint) expected on disk
    reason: str  # which limit chose the count


def plan_layers(shape: ModelShape, *, free_bytes: int, seconds: float, write_bytes_per_s: float,
                with_bf16_checkpoint: bool, max_layers: int, min_layers: int = 2,
                disk_share: float = 0.8) -> LayerPlan:
    """As many layers as `disk_share` of the free disk holds and `seconds` of writing allow, at most
    max_layers. Every layer is written about twice (GGUF, then the pack), plus its bf16 form when the
    accelerate contender needs a Hugging Face checkpoint."""
    per_layer = shape.experts * (shape.expert_bytes + shape.padded_expert_bytes
                                 + (shape.bf16_expert_bytes if with_bf16_checkpoint else 0))
    by_disk = int(free_bytes * disk_share // per_layer) + shape.dense_layers
    by_time = int(seconds * write_bytes_per_s // per_layer) + shape.dense_layers
    layers = min(by_disk, by_time, max_layers)
    if layers < min_layers:
        raise ShapeError(f"{shape.name}: {layers} layers fit ({by_disk} by {free_bytes} free bytes, {by_time} "
                         f"by {seconds:.0f} s at {write_bytes_per_s / 1e9:.2f} GB/s); at least {min_layers} needed")
    reason = {by_disk: "free disk", by_time: "preparation time", max_layers: "the layer cap"}[layers]
    return LayerPlan(layers, per_layer * shape.moe_layers(layers), reason)
