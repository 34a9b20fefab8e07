"""Each Kimi-K3 piece against llama.cpp's formula (src/models/kimi-k3.cpp), written out here on its own.

The references below read only the model's weights; they are transcriptions of llama.cpp's graph
(kimi_k3_situ, res_mix and the layer loop, build_latent_moe, build_mla_layer, build_kda_layer),
with llama.cpp's fused `<x>_res_score = res_norm.weight * res_proj.weight` used where llama.cpp
uses it. Norm weights, correction biases and residual pseudo-queries are randomized first:
their defaults (ones, zeros) would let a wrong formula pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from inference.models.kimi_k3.attention_kimi_k3 import KimiK3DeltaAttention, KimiK3MLAAttention
from inference.models.kimi_k3.modeling_kimi_k3 import mix_attention_residuals
from inference.models.kimi_k3.moe_kimi_k3 import KimiK3SparseMoeBlock
from packtools.arch import tiny_config

EPS = 1e-6  # tiny_config("kimi_k3") rms_norm_eps, and Moonshot's MLA/KDA l2 epsilon
TOKENS = 7


def rms(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = EPS) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None and linear_beta > 0:
        up = linear_beta * torch.tanh(up / linear_beta)
    return act * up


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_config("kimi_k3", num_layers=4)  # layers 0-2 KDA, 3 MLA; 0 dense; banks at 0 and 2
    config.activation_situ_beta, config.activation_situ_linear_beta = 0.5, 0.3  # caps that bite
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight") or "layernorm" in name:
                tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith(("e_score_correction_bias", "res_proj.weight")):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            elif tensor.dim() >= 2 and "embed" not in name:  # larger weights: activations reach the caps
                tensor.mul_(5)
    return model


def normed_input(model, seed: int = 4) -> torch.Tensor:
    return torch.randn(1, TOKENS, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))


def test_situ_is_soft_capped_silu_times_soft_capped_up(model):
    experts = model.model.layers[1].mlp.experts
    gate_up = 3 * torch.randn(5, 2 * experts.intermediate_dim, generator=torch.Generator().manual_seed(2))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(experts._apply_gate(gate_up), situ(gate, up, 0.5, 0.3))
    assert not torch.allclose(experts._apply_gate(gate_up), F.silu(gate) * up, atol=1e-2)  # it is not SwiGLU
    dense = model.model.layers[0].mlp
    x = normed_input(model)[0]
    expected = situ(x @ dense.gate_proj.weight.T, x @ dense.up_proj.weight.T, 0.5, 0.3) @ dense.down_proj.weight.T
    torch.testing.assert_close(dense(x), expected)


def test_situ_without_linear_beta_leaves_up_linear():
    config = tiny_config("kimi_k3", num_layers=2)
    config.activation_situ_linear_beta = None
    experts = AutoModelForCausalLM.from_config(config).model.layers[1].mlp.experts
    gate_up = 40 * torch.randn(3, 2 * experts.intermediate_dim, generator=torch.Generator().manual_seed(3))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(experts._apply_gate(gate_up), situ(gate, up, 4.0, None))


def res_mix(stack: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """llama.cpp res_mix: scores of rms-normed candidates against the fused score vector, softmax,
    then the raw candidates summed (layer 0, nothing banked: the current stream itself)."""
    if not stack:
        return current
    candidates = [*stack, current]
    scores = torch.stack([(rms(v) * score).sum(-1) for v in candidates], dim=-1)  # [B, T, n]
    probs = torch.softmax(scores, dim=-1)
    return sum(probs[..., i:i + 1] * v for i, v in enumerate(candidates))


def test_attention_residual_mix_matches_llamacpp_res_mix(model):
    layer = model.model.layers[2]
    score = layer.mlp_res_norm.weight * layer.mlp_res_proj.weight[0]  # llama.cpp's fused ffn_res_score
    stack = [normed_input(model, seed) * (seed + 1) for seed in range(3)]
    current = normed_input(model, 9)
    got = mix_attention_residuals(stack, current, layer.mlp_res_norm, layer.mlp_res_proj)
    torch.testing.assert_close(got, res_mix(stack, current, score))
    assert mix_attention_residuals([], current, layer.mlp_res_norm, layer.mlp_res_proj) is current


def test_layer_loop_banks_and_mixes_like_llamacpp(model):
    """The whole model with llama.cpp's residual wiring around the model's own sub-layers."""
    ids = torch.randint(3, 512, (1, TOKENS), generator=torch.Generator().manual_seed(5))
    causal = torch.full((TOKENS, TOKENS), float("-inf")).triu(1)[None, None]  # additive mask for MLA
    block = model.config.attn_res_block_size
    with torch.no_grad():
        inp, stack = model.model.embed_tokens(ids), []
        for il, layer in enumerate(model.model.layers):
            prefix_sum = inp
            attn_score = layer.self_attention_res_norm.weight * layer.self_attention_res_proj.weight[0]
            cur = res_mix(stack, prefix_sum, attn_score)
            banked = il % block == 0
            if banked:
                stack.append(prefix_sum)  # the raw layer input
            normed = layer.input_layernorm(cur)
            if isinstance(layer.self_attn, KimiK3MLAAttention):
                cur = layer.self_attn(normed, attention_mask=causal)[0]
            else:
                cur = layer.self_attn(normed)
            prefix_sum = cur if banked else prefix_sum + cur
            cur = res_mix(stack, prefix_sum, layer.mlp_res_norm.weight * layer.mlp_res_proj.weight[0])
            inp = prefix_sum + layer.mlp(layer.post_attention_layernorm(cur))
        out = res_mix(stack, inp, model.model.output_attn_res_norm.weight * model.model.output_attn_res_proj.weight[0])
        expected = model.lm_head(model.model.norm(out))
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_latent_moe_matches_build_latent_moe(model):
    block: KimiK3SparseMoeBlock = model.model.layers[1].mlp
    config = model.config
    x = normed_input(model)[0]  # [T, H]
    probs = torch.sigmoid(x @ block.gate.weight.T)  # the router reads the full-width input
    chosen = torch.topk(probs + block.gate.e_score_correction_bias, config.num_experts_per_token, dim=-1).indices
    weights = probs.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * config.routed_scaling_factor
    latent = x @ block.routed_expert_down_proj.weight.T  # [T, L]
    inter = config.moe_intermediate_size
    routed = torch.zeros_like(latent)
    for t in range(TOKENS):
        for slot, expert in enumerate(chosen[t].tolist()):
            w13 = block.experts.gate_up_proj[expert]  # [2I, L]: w1 (gate) rows, then w3 (up) rows
            hidden = situ(w13[:inter] @ latent[t], w13[inter:] @ latent[t], 0.5, 0.3)
            routed[t] += weights[t, slot] * (block.experts.down_proj[expert] @ hidden)
    routed = rms(routed, block.routed_expert_norm.weight) @ block.routed_expert_up_proj.weight.T  # [T, H]
    shared = block.shared_experts
    shared_hidden = situ(x @ shared.gate_proj.weight.T, x @ shared.up_proj.weight.T, 0.5, 0.3)
    expected = routed + shared_hidden @ shared.down_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(block(x[None])[0], expected, rtol=1e-5, atol=1e-5)


def test_mla_output_gate_matches_build_mla_layer(model):
    attn: KimiK3MLAAttention = model.model.layers[3].self_attn
    x = normed_input(model)[0]
    heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    v_dim, rank = attn.v_head_dim, attn.kv_lora_rank
    q = (rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight) @ attn.q_b_proj.weight.T).view(TOKENS, heads, -1)
    kv_a = x @ attn.kv_a_proj_with_mqa.weight.T
    kv = (rms(kv_a[:, :rank], attn.kv_a_layernorm.weight) @ attn.kv_b_proj.weight.T).view(TOKENS, heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], kv_a[:, None, rank:].expand(TOKENS, heads, rope)], dim=-1)  # no RoPE
    scores = torch.einsum("thd,shd->hts", q, k) / (nope + rope) ** 0.5
    scores = scores.masked_fill(torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., nope:]).reshape(TOKENS, heads * v_dim)
    expected = (out * torch.sigmoid(x @ attn.g_proj.weight.T)) @ attn.o_proj.weight.T  # gate on the normed input
    causal = torch.full((TOKENS, TOKENS), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        torch.testing.assert_close(attn(x[None], attention_mask=causal)[0][0], expected, rtol=1e-5, atol=1e-5)


def test_kda_full_rank_gate_and_lower_bound_decay_match_build_kda_layer(model):
    attn: KimiK3DeltaAttention = model.model.layers[2].self_attn
    x = normed_input(model)[0]
    heads, dim, kernel = attn.num_heads, attn.head_dim, attn.conv_kernel_size

    def conv_silu(proj: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # causal depthwise, [T, d]
        padded = F.pad(proj.T, (kernel - 1, 0))  # [d, T + K - 1]
        return F.silu(torch.stack([(padded[:, t:t + kernel] * weight[:, 0]).sum(-1) for t in range(TOKENS)]))

    def l2(v: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt(v.pow(2).sum(-1, keepdim=True) + EPS)

    q = l2(conv_silu(x @ attn.q_proj.weight.T, attn.q_conv1d.weight).view(TOKENS, heads, dim))
    k = l2(conv_silu(x @ attn.k_proj.weight.T, attn.k_conv1d.weight).view(TOKENS, heads, dim))
    v = conv_silu(x @ attn.v_proj.weight.T, attn.v_conv1d.weight).view(TOKENS, heads, dim)
    raw = (x @ attn.f_a_proj.weight.T @ attn.f_b_proj.weight.T + attn.dt_bias).view(TOKENS, heads, dim)
    g = -5.0 * torch.sigmoid(attn.A_log.exp()[:, None] * raw)  # gate_lower_bound * sigmoid(exp(A_log) * (...))
    beta = torch.sigmoid(x @ attn.b_proj.weight.T)  # [T, heads]
    state = torch.zeros(heads, dim, dim)  # [heads, k, v]
    outs = []
    for t in range(TOKENS):
        state = state * g[t].exp()[:, :, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + torch.einsum("hk,hv->hkv", k[t], delta)
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]) / dim ** 0.5)
    core = torch.stack(outs)  # [T, heads, dim]
    gate = torch.sigmoid(x @ attn.g_proj.weight.T).view(TOKENS, heads, dim)  # one full-rank gate
    expected = (rms(core, attn.o_norm.weight) * gate).reshape(TOKENS, -1) @ attn.o_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(attn.decay(x[None])[0], g)
        torch.testing.assert_close(attn(x[None])[0], expected, rtol=1e-4, atol=1e-5)
