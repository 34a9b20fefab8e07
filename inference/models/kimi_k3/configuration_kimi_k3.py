"""Kimi-K3 text configuration, with the attribute names of Moonshot's config.json.

The official checkpoint's config.json is a multimodal wrapper (`"architectures":
["KimiK3ForConditionalGeneration"]`, `"model_type": "kimi_k3"`) whose language model sits in
`text_config` (there `"model_type": "kimi_linear"`). This class reads either form: a `text_config`
given to it is lifted to the top level (text keys win, as in llama.cpp's converter), so
`AutoConfig.from_pretrained(<official dir>)` and `AutoConfig.for_model("kimi_k3", **text_keys)`
give the same config. Layer kinds come from `linear_attn_config` (1-based `full_attn_layers` /
`kda_layers`, as Moonshot writes them) and are exposed as transformers' `layer_types`.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

# Keys of the wrapper's text_config that describe the wrapper, not the text model.
_WRAPPER_ONLY_KEYS = ("model_type", "architectures", "auto_map")
SUPPORTED_ACTIVATIONS = ("situ", "silu")


@strict
class KimiK3Config(PreTrainedConfig):
    r"""
    Kimi-K3: hybrid KDA (linear) + MLA (full, no RoPE) attention, cross-layer attention residuals,
    latent MoE with shared experts, SiTU activation.

    linear_attn_config (`dict`): `num_heads`, `head_dim`, `short_conv_kernel_size`, `gate_lower_bound`
        (None: Kimi-Linear's softplus decay), `use_full_rank_gate` (must be true), `full_attn_layers` and
        `kda_layers` (1-based layer numbers).
    routed_expert_hidden_size (`int`, *optional*): width of the latent space routed experts run in;
        None runs them at `hidden_size`.
    latent_moe_use_norm (`bool`): RMS-normalize the routed experts' weighted sum before the up-projection.
    attn_res_block_size (`int`, *optional*): layers per attention-residual block; None: plain residuals.
    activation_situ_beta / activation_situ_linear_beta (`float`): SiTU soft caps of the gate and up branch
        (a linear beta <= 0 or None leaves the up branch linear).
    """

    model_type = "kimi_k3"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "n_group": "num_expert_group",
        "norm_topk_prob": "moe_renormalize",
    }

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    moe_intermediate_size: int = 3072
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    # MLA (full-attention layers)
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    # KDA (linear-attention layers)
    linear_attn_config: dict | None = None
    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    first_k_dense_replace: int = 1
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 2.446
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    num_expert_group: int = 1
    topk_group: int = 1
    # cross-layer attention residuals
    attn_res_block_size: int | None = 12
    # generic
    max_position_embeddings: int = 262144
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = 163839
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    tie_word_embeddings: bool = False
    output_router_logits: bool = False
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        kwargs = self._lift_text_config(kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.head_dim = self.qk_rope_head_dim  # as kimi_linear: what generic cache code reads
        self._check_supported()
        self._resolve_layer_kinds()
        super().__post_init__(**kwargs)

    def _lift_text_config(self, kwargs: dict) -> dict:
        text_config = kwargs.pop("text_config", None)
        if not text_config:
            return kwargs
        if not isinstance(text_config, dict):
            text_config = text_config.to_dict()
        field_names = set(self.__dataclass_fields__) | set(self.attribute_map)
        for key, value in text_config.items():
            if key in _WRAPPER_ONLY_KEYS:
                continue
            if key in field_names:
                setattr(self, key, value)
            else:
                kwargs[key] = value
        return kwargs

    def _check_supported(self) -> None:
        if not self.mla_use_nope:
            raise ValueError("KimiK3Config: mla_use_nope=False (rotary MLA) is not Kimi-K3 and is not implemented")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"KimiK3Config: hidden_act {self.hidden_act!r} not in {SUPPORTED_ACTIVATIONS}")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(f"KimiK3Config: moe_router_activation_func {self.moe_router_activation_func!r} "
                             "is not 'sigmoid' (the only router Kimi-K3 has)")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"KimiK3Config: attn_res_block_size {self.attn_res_block_size} must be >= 1 or None")

    def _resolve_layer_kinds(self) -> None:
        linear = dict(self.linear_attn_config or {})
        linear.setdefault("num_heads", self.num_attention_heads)
        linear.setdefault("head_dim", 128)
        linear.setdefault("short_conv_kernel_size", 4)
        linear.setdefault("gate_lower_bound", -5.0)
        linear.setdefault("use_full_rank_gate", True)
        if not linear["use_full_rank_gate"]:
            raise ValueError("KimiK3Config: linear_attn_config.use_full_rank_gate=False (Kimi-Linear's low-rank "
                             "g_a/g_b gate) is not Kimi-K3 and is not implemented")
        layers = self.num_hidden_layers
        if "full_attn_layers" in linear:
            full = {int(n) for n in linear["full_attn_layers"]}
            if any(not 1 <= n <= layers for n in full):
                raise ValueError(f"KimiK3Config: full_attn_layers {sorted(full)} must be 1-based numbers <= {layers}")
            kinds = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
            if self.layer_types is not None and list(self.layer_types) != kinds:
                raise ValueError(f"KimiK3Config: layer_types {self.layer_types} disagree with "
                                 f"linear_attn_config.full_attn_layers {sorted(full)}")
        elif self.layer_types is not None:
            kinds = list(self.layer_types)
        else:  # Kimi-Linear's default pattern: every fourth layer is MLA
            kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        if len(kinds) != layers or set(kinds) - {"full_attention", "linear_attention"}:
            raise ValueError(f"KimiK3Config: layer_types {kinds} must be {layers} of full_attention/linear_attention")
        linear["full_attn_layers"] = [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"]
        linear["kda_layers"] = [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"]
        self.linear_attn_config = linear
        self.layer_types = kinds
        self.linear_num_heads = int(linear["num_heads"])
        self.linear_head_dim = int(linear["head_dim"])
        self.linear_conv_kernel_dim = int(linear["short_conv_kernel_size"])
        self.kda_gate_lower_bound = linear["gate_lower_bound"]
        dense = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(layers)]
        if self.mlp_layer_types is not None and list(self.mlp_layer_types) != dense:
            raise ValueError(f"KimiK3Config: mlp_layer_types {self.mlp_layer_types} disagree with "
                             f"first_k_dense_replace={self.first_k_dense_replace}")
        self.mlp_layer_types = dense

    @property
    def expert_hidden_size(self) -> int:
        """Input/output width of a routed expert: the latent width when there is one."""
        return self.routed_expert_hidden_size or self.hidden_size


__all__ = ["KimiK3Config"]
