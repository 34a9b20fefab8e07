"""Kimi-K3 dense tensors: official checkpoint name <-> `kimi-k3` GGUF tensor(s), with the
converter's transforms and their inverses.

Names are the kimi_k3 model's state_dict keys, which are the official checkpoint's with the
`language_model.` prefix dropped, except `block_sparse_moe.` -> `mlp.` in MoE layers (both spellings
are accepted, since checkpoints and the model's state_dict spell them differently;
inference.models.kimi_k3); GGUF names are
llama.cpp's (vendored gguf-py TENSOR_NAMES / src/llama-arch.cpp), spelled here because gguf-py
0.19 has no KIMI_K3. Transforms the converter applies, undone on reading:

- kv_b_proj [n_head*(nope+v), kv_lora] -> attn_k_b [n_head, kv_lora, nope] (transposed) + attn_v_b;
- {q,k,v}_conv1d [D, 1, K] -> numpy (1, D, 1, K): a pure reshape;
- A_log [n_head] -> ssm_a = -exp(A_log) in float32; read back as the float32 nearest log(-ssm_a)
  whose exp is exactly -ssm_a: the model's exp(A_log) is llama.cpp's A bit for bit, and A_log is
  the original for ~87% of typical values, else within 2^-24 of it (near 0, where many A_log share
  one exp, mostly not bit-exact; tests/packtools/test_gguf_kimi_k3.py measures it);
- dt_bias -> ssm_dt.bias (a rename);
- g_proj is two tensors under one name: the full-rank KDA gate (ssm_g) on KDA layers, the MLA
  output gate (attn_gate) on MLA layers;
- `<x>_res_norm.weight` [H] and `<x>_res_proj.weight` [1, H] -> one `*_res_score` = norm * proj.
  llama.cpp uses the pair only as sum(rms_norm(x) * norm * proj) (kimi-k3.cpp res_mix), so the
  fused vector goes to the norm and the projection becomes ones: the model then computes
  sum(rms_norm(x) * fused * 1), exactly llama.cpp's score. The split itself is not recoverable.
"""

from __future__ import annotations

import re

import torch
from transformers import PretrainedConfig

from packtools.gguf.errors import TensorMappingError
from packtools.gguf.tensor_rules import DenseRule, Tensors, identity_in, identity_out, kv_b_split_join

_LAYER = r"model\.layers\.(?P<bid>\d+)\."
# MoE layers: `block_sparse_moe.` in the checkpoint, `mlp.` in the kimi_k3 model's state_dict
_MOE = _LAYER + r"(?:block_sparse_moe|mlp)\."

# official name (regex, `bid` = layer) -> GGUF name template; identity transform
_PLAIN: dict[str, str] = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    _LAYER + r"input_layernorm\.weight": "blk.{bid}.attn_norm.weight",
    _LAYER + r"post_attention_layernorm\.weight": "blk.{bid}.ffn_norm.weight",
    # attention projections: KDA and MLA layers share q_proj / o_proj names
    _LAYER + r"self_attn\.q_proj\.weight": "blk.{bid}.attn_q.weight",
    _LAYER + r"self_attn\.k_proj\.weight": "blk.{bid}.attn_k.weight",
    _LAYER + r"self_attn\.v_proj\.weight": "blk.{bid}.attn_v.weight",
    _LAYER + r"self_attn\.o_proj\.weight": "blk.{bid}.attn_output.weight",
    # KDA
    _LAYER + r"self_attn\.f_a_proj\.weight": "blk.{bid}.ssm_f_a.weight",
    _LAYER + r"self_attn\.f_b_proj\.weight": "blk.{bid}.ssm_f_b.weight",
    _LAYER + r"self_attn\.b_proj\.weight": "blk.{bid}.ssm_beta.weight",
    _LAYER + r"self_attn\.dt_bias": "blk.{bid}.ssm_dt.bias",
    _LAYER + r"self_attn\.o_norm\.weight": "blk.{bid}.ssm_norm.weight",
    # MLA
    _LAYER + r"self_attn\.q_a_proj\.weight": "blk.{bid}.attn_q_a.weight",
    _LAYER + r"self_attn\.q_b_proj\.weight": "blk.{bid}.attn_q_b.weight",
    _LAYER + r"self_attn\.q_a_layernorm\.weight": "blk.{bid}.attn_q_a_norm.weight",
    _LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight": "blk.{bid}.attn_kv_a_mqa.weight",
    _LAYER + r"self_attn\.kv_a_layernorm\.weight": "blk.{bid}.attn_kv_a_norm.weight",
    # dense MLP (the first_k_dense_replace layers)
    _LAYER + r"mlp\.gate_proj\.weight": "blk.{bid}.ffn_gate.weight",
    _LAYER + r"mlp\.up_proj\.weight": "blk.{bid}.ffn_up.weight",
    _LAYER + r"mlp\.down_proj\.weight": "blk.{bid}.ffn_down.weight",
    # MoE: router, shared experts, latent projections
    _MOE + r"gate\.weight": "blk.{bid}.ffn_gate_inp.weight",
    _MOE + r"gate\.e_score_correction_bias": "blk.{bid}.exp_probs_b.bias",
    _MOE + r"shared_experts\.gate_proj\.weight": "blk.{bid}.ffn_gate_shexp.weight",
    _MOE + r"shared_experts\.up_proj\.weight": "blk.{bid}.ffn_up_shexp.weight",
    _MOE + r"shared_experts\.down_proj\.weight": "blk.{bid}.ffn_down_shexp.weight",
    _MOE + r"routed_expert_down_proj\.weight": "blk.{bid}.ffn_routed_down.weight",
    _MOE + r"routed_expert_up_proj\.weight": "blk.{bid}.ffn_routed_up.weight",
    _MOE + r"routed_expert_norm\.weight": "blk.{bid}.ffn_routed_norm.weight",
}
_PLAIN_RE = [(re.compile(f"^{pattern}$"), template) for pattern, template in _PLAIN.items()]

_CONV = re.compile(f"^{_LAYER}self_attn\\.(?P<part>[qkv])_conv1d\\.weight$")
_A_LOG = re.compile(f"^{_LAYER}self_attn\\.A_log$")
_G_PROJ = re.compile(f"^{_LAYER}self_attn\\.g_proj\\.weight$")
_KV_B = re.compile(f"^{_LAYER}self_attn\\.kv_b_proj\\.weight$")
# the three cross-layer residual scorers: official prefix -> fused GGUF tensor
_RES = re.compile(r"^(?:model\.layers\.(?P<bid>\d+)\.(?P<kind>self_attention|mlp)|model\.output_attn)_res_"
                  r"(?P<part>norm|proj)\.weight$")
_RES_SCORE = {"self_attention": "blk.{bid}.attn_res_score.weight", "mlp": "blk.{bid}.ffn_res_score.weight",
              None: "output_res_score.weight"}


def full_attention_layers(config: PretrainedConfig) -> set[int]:
    """0-indexed MLA layers (linear_attn_config.full_attn_layers counts from 1)."""
    return {n - 1 for n in config.linear_attn_config["full_attn_layers"]}


def dense_rule(config: PretrainedConfig, name: str) -> DenseRule:
    """How the official dense tensor `name` is stored in a kimi-k3 GGUF."""
    for pattern, template in _PLAIN_RE:
        if match := pattern.match(name):
            return DenseRule(name, (template.format(**match.groupdict()),), identity_out, identity_in)
    if match := _CONV.match(name):
        return DenseRule(name, (f"blk.{match['bid']}.ssm_conv1d_{match['part']}.weight",), _conv_out, _conv_in)
    if match := _A_LOG.match(name):
        return DenseRule(name, (f"blk.{match['bid']}.ssm_a",), a_log_to_gguf, a_log_from_gguf)
    if match := _G_PROJ.match(name):
        bid = int(match["bid"])
        gguf_name = f"blk.{bid}.attn_gate.weight" if bid in full_attention_layers(config) else f"blk.{bid}.ssm_g.weight"
        return DenseRule(name, (gguf_name,), identity_out, identity_in)
    if match := _KV_B.match(name):
        return _kv_b_rule(config, name, match["bid"])
    if match := _RES.match(name):
        return _res_rule(name, _RES_SCORE[match["kind"]].format(bid=match["bid"]), match["part"], config.hidden_size)
    raise TensorMappingError(f"kimi_k3: {name!r} has no kimi-k3 GGUF tensor in packtools' table "
                             "(packtools/gguf/kimi_k3_tensors.py)")


def _conv_out(conv: torch.Tensor) -> Tensors:  # [D, 1, K] -> numpy (1, D, 1, K), i.e. ggml ne [K, 1, D, 1]
    d_inner, kernel = conv.shape[0], conv.shape[-1]
    return (conv.reshape(1, d_inner, 1, kernel),)


def _conv_in(tensors: Tensors) -> torch.Tensor:  # (1, D, 1, K) or (D, 1, K) after quantization -> [D, 1, K]
    conv = tensors[0]
    return conv.reshape(-1, 1, conv.shape[-1])


def a_log_to_gguf(a_log: torch.Tensor) -> Tensors:
    return (-torch.exp(a_log.float()),)  # what the converter stores: A itself, in float32


def a_log_from_gguf(tensors: Tensors) -> torch.Tensor:
    """An A_log whose float32 exp is exactly -A, so the model's decay equals llama.cpp's bit for bit.

    The original always satisfies exp(A_log) == -A (that is how the converter made A); log(-A)
    alone does for ~99.98% of values. Of log(-A) and its two float32 neighbours the first that
    does is taken.
    """
    minus_a = -tensors[0].float()
    guess = torch.log(minus_a)
    chosen = guess.clone()
    unresolved = torch.exp(guess) != minus_a
    for direction in (float("inf"), float("-inf")):
        neighbour = torch.nextafter(guess, torch.full_like(guess, direction))
        fits = unresolved & (torch.exp(neighbour) == minus_a)
        chosen = torch.where(fits, neighbour, chosen)
        unresolved &= ~fits
    return chosen


def _kv_b_rule(config: PretrainedConfig, name: str, bid: str) -> DenseRule:
    split, join = kv_b_split_join(config)
    # llama.cpp also loads an unsplit attn_kv_b (TENSOR_SKIP_IF_VIRTUAL); read either form
    unsplit = DenseRule(name, (f"blk.{bid}.attn_kv_b.weight",), identity_out, identity_in)
    return DenseRule(name, (f"blk.{bid}.attn_k_b.weight", f"blk.{bid}.attn_v_b.weight"), split, join, fallback=unsplit)


def _res_rule(name: str, score_name: str, part: str, hidden: int) -> DenseRule:
    def not_writable(tensor: torch.Tensor) -> Tensors:
        raise TensorMappingError(f"{name}: a kimi-k3 GGUF holds only the product res_norm * res_proj "
                                 f"({score_name}); packtools does not write kimi-k3 GGUFs (llama.cpp's converter does)")

    if part == "norm":
        return DenseRule(name, (score_name,), not_writable, identity_in)
    # the projection reads no tensor: ones, so that norm (= the fused score vector) * proj is the product
    return DenseRule(name, (), not_writable, lambda _: torch.ones(1, hidden))
