"""Dense tensors: transformers 5 state_dict key <-> GGUF tensor(s), both directions from one rule.

Names go through gguf-py's TensorNameMap (the table llama.cpp's converter uses). A few
transformers 5 keys differ from the checkpoint names that table knows (the routers'
e_score_correction_bias here; kimi_linear's forget gate, gpt_oss's sinks in their records'
`respell`); they are respelled first. Where llama.cpp's converter transforms a tensor, the rule
carries the transform and its inverse: MLA's kv_b_proj split into k_b (transposed) and v_b here,
the rest in the architecture's record (`special_dense_rule`: mixtral's rope permutation,
kimi_linear's conv1d split and A = -exp(A_log)). Archs gguf-py lacks name every tensor in their own
table (`own_dense_rule`).
"""

from __future__ import annotations

import re

import gguf
from transformers import PretrainedConfig

from packtools.gguf.archs import arch_for_model_type
from packtools.gguf.errors import TensorMappingError
from packtools.gguf.gguf_arch import GGUFArch
from packtools.gguf.tensor_rules import DenseRule, identity_in, identity_out, kv_b_split_join

# transformers 5 keys of routed experts: "model.layers.N.mlp.experts.<param>"
ROUTED_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\w+)$")
_SUFFIXES = (".weight", ".bias")


class TensorMapper:
    """Dense-tensor rules for one transformers config."""

    def __init__(self, config: PretrainedConfig):
        self.config = config
        self.arch: GGUFArch = arch_for_model_type(config.model_type)
        # archs gguf-py 0.19 does not know have no TensorNameMap: their own table (own_dense_rule) maps them
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
        return self.arch.respell(name) if self.arch.respell is not None else name

    def dense_rule(self, hf_name: str) -> DenseRule:
        if self.routed_expert(hf_name) is not None:
            raise TensorMappingError(f"{hf_name!r} is a routed expert tensor, not a dense one")
        if self.names is None:
            return self.arch.own_dense_rule(self.config, hf_name)
        name = self._checkpoint_spelling(hf_name)
        if self.arch.special_dense_rule is not None:
            rule = self.arch.special_dense_rule(self.config, hf_name, name, self.gguf_name)
            if rule is not None:
                return rule
        if self.arch.mla and name.endswith("self_attn.kv_b_proj.weight"):
            return self._kv_b_rule(hf_name, name)
        return DenseRule(hf_name, (self.gguf_name(name),), identity_out, identity_in)

    def _kv_b_rule(self, hf_name: str, name: str) -> DenseRule:
        names = tuple(self.gguf_name(name.replace("kv_b_proj", part)) for part in ("k_b_proj", "v_b_proj"))
        split, join = kv_b_split_join(self.config)
        unsplit = DenseRule(hf_name, (self.gguf_name(name),), identity_out, identity_in)
        return DenseRule(hf_name, names, split, join, fallback=unsplit)
