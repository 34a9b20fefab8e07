"""What one architecture is in GGUF: llama.cpp's arch name, the config it reads and writes, and
how its dense tensors are named. Each architecture module (packtools.arch.models) gives one;
packtools.gguf.archs, config_read, config_write and tensor_map apply them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
from transformers import PretrainedConfig

from packtools.gguf.config_parts import TensorFacts
from packtools.gguf.metadata import Metadata
from packtools.gguf.tensor_rules import DenseRule

MODEL_ARCH = gguf.MODEL_ARCH

# (metadata, tensor facts, the kwargs every arch reads alike) -> this arch's further config kwargs
ConfigReader = Callable[[Metadata, TensorFacts, dict], dict]
# adds this arch's keys to the writer (the keys every arch writes alike are written already)
ConfigWriter = Callable[[gguf.GGUFWriter, PretrainedConfig], None]
# (config, transformers key, the name llama.cpp's converter sees, gguf-py's name of a converter
# name) -> the rule, or None where the plain renaming applies
SpecialDenseRule = Callable[[PretrainedConfig, str, str, Callable[[str], str]], DenseRule | None]


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    model_type: str  # transformers model_type
    gguf_arch: gguf.MODEL_ARCH | None  # None: an arch gguf-py 0.19 does not know (named by arch_name)
    # llama.cpp renormalises the top-k weights of this arch unconditionally (True/False) when the
    # file has no expert_weights_norm key; None: the arch has no such switch in transformers.
    implied_norm_topk: bool | None
    norm_topk_attr: str | None  # transformers config attribute of that switch
    read_config: ConfigReader
    # None: packtools reads this arch's GGUFs (llama.cpp's converter writes them) but does not write
    # them (packtools synth --format gguf refuses it)
    write_config: ConfigWriter | None = None
    mla: bool = False  # multi-head latent attention (kv_b split into k_b / v_b)
    arch_name: str | None = None  # general.architecture, for archs newer than gguf-py 0.19
    # where one GGUF arch is several transformers models (deepseek2: DeepSeek-V2 and V3), the
    # expert_gating_func value that picks this one; `gating_when_absent`: llama.cpp reads this
    # model's gating when the file has no gating key
    gating_func: int | None = None
    gating_when_absent: bool = False
    # the router has expert-selection biases (exp_probs_b); a file that has them is not this model
    # where False. `selection_bias_hint` says in the refusal what such a file likely is.
    selection_bias: bool = True
    selection_bias_hint: str = ""
    dense_ffn: bool = True  # the file has feed_forward_length (False: every FFN is MoE)
    rope: bool = True  # False: the attention is NoPE, the config has no rope_parameters
    yarn_log_mul: bool = False  # yarn mscale stored as yarn_log_multiplier (DeepSeek-2's convention)
    yarn_truncate: bool | None = None  # rope_parameters.truncate the arch's GGUFs imply (gpt-oss: False)
    ffn_act: str | None = "silu"  # hidden_act llama.cpp's graph computes; None: the graph's own
    # transformers 5 key -> the checkpoint name llama.cpp's converter sees (beyond the spellings
    # every arch shares, packtools.gguf.tensor_map)
    respell: Callable[[str], str] | None = None
    special_dense_rule: SpecialDenseRule | None = None  # tensors the converter transforms
    # archs gguf-py lacks (no TensorNameMap): every dense tensor's rule, from the arch's own table
    own_dense_rule: Callable[[PretrainedConfig, str], DenseRule] | None = None
    # config attribute counting the multi-token-prediction layers llama.cpp's converter appends as
    # extra blocks (nextn_predict_layers); None: the arch's GGUFs have none
    mtp_layers_attr: str | None = None

    def __post_init__(self) -> None:
        if self.gguf_arch is None and self.arch_name is None:
            raise ValueError(f"{self.model_type}: a GGUF arch needs gguf_arch or arch_name")
        if self.gguf_arch is None and self.own_dense_rule is None:
            raise ValueError(f"{self.model_type}: an arch gguf-py does not know needs own_dense_rule")
        if (self.implied_norm_topk is None) != (self.norm_topk_attr is None):
            raise ValueError(f"{self.model_type}: implied_norm_topk and norm_topk_attr go together")

    @property
    def gguf_name(self) -> str:
        return self.arch_name or gguf.MODEL_ARCH_NAMES[self.gguf_arch]
