"""Dense tensors: transformers 5 state_dict key <-> GGUF tensor(s), both directions from one rule.

Names go through gguf-py's TensorNameMap (the table llama.cpp's converter uses). A few
transformers 5 keys differ from the checkpoint names that table knows (kimi_linear's forget
gate, gpt_oss's sinks, the routers' e_score_correction_bias); they are respelled first. Where
llama.cpp's converter transforms a tensor, the rule carries the transform and its inverse:

- LLAMA (mixtral): Q and K rows permuted for llama.cpp's rope layout;
- DEEPSEEK2 / KIMI_LINEAR: kv_b_proj split into k_b (transposed) and v_b for the MLA cache;
- KIMI_LINEAR: the fused q/k/v conv1d split in three, A_log stored as A = -exp(A_log).
"""

from __future__ import annotations

import importlib
import re

import gguf
import torch
from transformers import PretrainedConfig

from packtools.gguf.archs import MODEL_ARCH, GGUFArch, arch_for_model_type
from packtools.gguf.dense_rule import DenseRule, Tensors, identity_in, identity_out, kv_b_split_join
from packtools.gguf.errors import TensorMappingError

# transformers 5 keys of routed experts: "model.layers.N.mlp.experts.<param>"
ROUTED_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\w+)$")
_SUFFIXES = (".weight", ".bias")
# model_type -> module with `dense_rule(config, hf_name) -> DenseRule`, for archs gguf-py 0.19 lacks
OWN_TABLES = {"kimi_k3": "packtools.gguf.kimi_k3_tensors", "deepseek_v4": "packtools.gguf.deepseek4"}


def permute_for_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rows from [x0..x(d/2), y0..] to interleaved pairs."""
    half = weight.shape[0] // n_head // 2  # rows per head / 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_for_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class TensorMapper:
    """Dense-tensor rules for one transformers config."""

    def __init__(self, config: PretrainedConfig):
        self.config = config
        self.arch: GGUFArch = arch_for_model_type(config.model_type)
        # archs gguf-py 0.19 does not know have no TensorNameMap: their own table (OWN_TABLES) maps them
        known = self.arch.gguf_arch is not None
        self.names = gguf.get_tensor_name_map(self.arch.gguf_arch, config.num_hidden_layers) if known else None

    @staticmethod
    def routed_expert(hf_name: str) -> tuple[int, str] | None:
        """(layer, parameter) if `hf_name` is a routed expert parameter, else None."""
        match = ROUTED_EXPERT_KEY.match(hf_name)
        return (int(match.group(1)), match.group(2)) if match else None

    def gguf_name(self, checkpoint_name: str) -> str:
        name = self.names.get_name(checkpoint_name, try_suffixes=_SUFFIXES)
        if name is None:
            raise TensorMappingError(
                f"{self.config.model_type}: {checkpoint_name!r} has no GGUF name in gguf-py's TensorNameMap "
                f"for {self.arch.gguf_name}"
            )
        return name

    def _checkpoint_spelling(self, hf_name: str) -> str:
        """The name llama.cpp's converter sees for this transformers 5 key."""
        name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        if self.arch.gguf_arch == MODEL_ARCH.GPT_OSS and name.endswith(".self_attn.sinks"):
            name += ".weight"
        if self.arch.gguf_arch == MODEL_ARCH.KIMI_LINEAR:
            name = name.replace(".forget_gate.", ".")
            name = re.sub(r"\.dt_bias$", ".dt_proj.bias", name)
        return name

    def dense_rule(self, hf_name: str) -> DenseRule:
        if self.routed_expert(hf_name) is not None:
            raise TensorMappingError(f"{hf_name!r} is a routed expert tensor, not a dense one")
        if self.names is None:
            return importlib.import_module(OWN_TABLES[self.config.model_type]).dense_rule(self.config, hf_name)
        name = self._checkpoint_spelling(hf_name)
        arch = self.arch.gguf_arch
        if arch == MODEL_ARCH.LLAMA and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            return self._llama_rope_rule(hf_name, name)
        if self.arch.mla and name.endswith("self_attn.kv_b_proj.weight"):
            return self._kv_b_rule(hf_name, name)
        if arch == MODEL_ARCH.KIMI_LINEAR and name.endswith("self_attn.conv1d.weight"):
            return self._kimi_conv_rule(hf_name, name)
        if arch == MODEL_ARCH.KIMI_LINEAR and name.endswith(".A_log"):
            # llama.cpp stores A itself; log(-A) recovers A_log to within float rounding
            return DenseRule(hf_name, (self.gguf_name(name),), lambda t: (-torch.exp(t),), lambda ts: torch.log(-ts[0]))
        return DenseRule(hf_name, (self.gguf_name(name),), identity_out, identity_in)

    def _llama_rope_rule(self, hf_name: str, name: str) -> DenseRule:
        is_key = name.endswith("k_proj.weight")
        n_head = self.config.num_key_value_heads if is_key else self.config.num_attention_heads
        return DenseRule(
            hf_name,
            (self.gguf_name(name),),
            lambda t: (permute_for_llama_rope(t, n_head),),
            lambda ts: unpermute_for_llama_rope(ts[0], n_head),
        )

    def _kv_b_rule(self, hf_name: str, name: str) -> DenseRule:
        names = tuple(self.gguf_name(name.replace("kv_b_proj", part)) for part in ("k_b_proj", "v_b_proj"))
        split, join = kv_b_split_join(self.config)
        unsplit = DenseRule(hf_name, (self.gguf_name(name),), identity_out, identity_in)
        return DenseRule(hf_name, names, split, join, fallback=unsplit)

    def _kimi_conv_rule(self, hf_name: str, name: str) -> DenseRule:
        names = tuple(self.gguf_name(name.replace("conv1d", f"{part}_conv1d")) for part in "qkv")

        def split(conv: torch.Tensor) -> Tensors:  # [3*D, 1, K]: q, k, v channels stacked
            d_inner, kernel = conv.shape[0] // 3, conv.shape[-1]
            # llama.cpp wants ggml ne [K, 1, D, 1], i.e. numpy (1, D, 1, K)
            return tuple(part.reshape(1, d_inner, 1, kernel).contiguous() for part in conv.split(d_inner, dim=0))

        def join(tensors: Tensors) -> torch.Tensor:
            parts = [t.reshape(t.shape[1], 1, t.shape[-1]) for t in tensors]
            return torch.cat(parts, dim=0)

        return DenseRule(hf_name, names, split, join)
