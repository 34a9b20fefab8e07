"""Bundles written straight from a live transformers model, plus the reference model they equal.

Independent of packtools' build: the pack is written with PackWriter from the model's own expert
parameters, each role in a chosen element type and layout. Quantized roles are quantized with
packtools.quants and the reference model's expert parameters are then overwritten with gguf-py's
dequantization of those bytes, so the reference holds exactly the weights the pack encodes.
Other test modules import `make_case` and `compare` (`one_thread` is in conftest.py); the tests here
check the factory itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from packformat import ElementType, PackWriter, Role
from packformat.bundle import open_bundle
from packtools.arch.registry import tiny_config
from packtools.quants.codec import dequantize, quantize

warnings.filterwarnings("ignore", message=".*fla.*|.*causal_conv1d.*|.*fast path.*")
_ROUTED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")

SWIGLU_ROLES = (Role.GATE, Role.UP, Role.DOWN)
GPT_OSS_ROLES = (Role.GATE_UP, Role.GATE_UP_BIAS, Role.DOWN, Role.DOWN_BIAS)  # transformers' own layout
GGUF_GPT_OSS_ROLES = (Role.GATE, Role.UP, Role.DOWN, Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS)


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """How the factory lays out each expert: roles in object order, orientation, gate_up layout, types."""

    roles: tuple[Role, ...] = SWIGLU_ROLES
    orientation: str = "out_in"
    gate_up: str = "concat"
    types: tuple[tuple[Role, ElementType], ...] = ()  # roles not listed are F32

    def type_of(self, role: Role) -> ElementType:
        return dict(self.types).get(role, ElementType.F32)


def default_layout(arch: str) -> PackLayout:
    if arch == "gpt_oss":
        return PackLayout(GPT_OSS_ROLES, "in_out", "interleaved")
    return PackLayout()


def make_reference_model(arch: str, *, seed: int = 0, hidden: int = 64, moe_intermediate: int = 32,
                         num_layers: int = 2, num_experts: int = 8, top_k: int = 2,
                         **config_overrides) -> torch.nn.Module:
    """A tiny random model of `arch` in float32 with weights large enough that experts matter."""
    config = tiny_config(arch, hidden_size=hidden, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                         moe_intermediate_size=moe_intermediate)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _ROUTED.match(name):  # experts: wide enough to move the logits, biases non-zero
                param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if "bias" in name else 0.15))
            elif name.endswith(("e_score_correction_bias", "router.bias")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
            if name.endswith("tid2eid"):  # hash routing: k distinct experts per token id
                picks = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                                     for _ in range(buffer.shape[0])])
                buffer.copy_(picks)
    return model


def _out_in_parts(module_params: dict[str, torch.Tensor], expert: int, transposed: bool,
                  concatenated: bool) -> dict[Role, torch.Tensor]:
    """gate, up [I, H], down [H, I] and biases of one expert, out_in, from the module's parameters."""
    gate_up = module_params["gate_up_proj"][expert]
    gate_up = gate_up.T if transposed else gate_up  # [2I, H]
    down = module_params["down_proj"][expert]
    parts = {Role.DOWN: down.T if transposed else down}
    if concatenated:
        parts[Role.GATE], parts[Role.UP] = gate_up.chunk(2, dim=0)
    else:
        parts[Role.GATE], parts[Role.UP] = gate_up[0::2], gate_up[1::2]
    if "gate_up_proj_bias" in module_params:
        bias = module_params["gate_up_proj_bias"][expert]
        parts[Role.GATE_BIAS], parts[Role.UP_BIAS] = bias.chunk(2) if concatenated else (bias[0::2], bias[1::2])
        parts[Role.DOWN_BIAS] = module_params["down_proj_bias"][expert]
    return {role: value.contiguous() for role, value in parts.items()}


def _fuse(gate: torch.Tensor, up: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "concat":
        return torch.cat([gate, up], dim=0)
    return torch.stack([gate, up], dim=1).flatten(0, 1)  # rows gate0, up0, gate1, ...


def _role_value(parts: dict[Role, torch.Tensor], role: Role, layout: PackLayout) -> torch.Tensor:
    if role == Role.GATE_UP:
        value = _fuse(parts[Role.GATE], parts[Role.UP], layout.gate_up)
    elif role == Role.GATE_UP_BIAS:
        value = _fuse(parts[Role.GATE_BIAS], parts[Role.UP_BIAS], layout.gate_up)
    else:
        value = parts[role]
    if value.dim() == 2 and layout.orientation == "in_out":
        value = value.T
    return value.contiguous()


def _encode(value: torch.Tensor, element_type: ElementType) -> tuple[bytes, torch.Tensor]:
    """(pack bytes, the float32 values those bytes decode to under gguf-py)."""
    raw = quantize(value.numpy().astype(np.float32), element_type)
    decoded = dequantize(raw, element_type).reshape(value.shape)
    return raw.tobytes(), torch.from_numpy(np.array(decoded, dtype=np.float32))


def _unparts(decoded: dict[Role, torch.Tensor], layout: PackLayout) -> dict[Role, torch.Tensor]:
    """Decoded role values back to out_in gate/up/down (+ biases)."""
    parts = {}
    for role, value in decoded.items():
        if value.dim() == 2 and layout.orientation == "in_out":
            value = value.T
        if role in (Role.GATE_UP, Role.GATE_UP_BIAS):
            first, second = (value.chunk(2, dim=0) if layout.gate_up == "concat" else (value[0::2], value[1::2]))
            names = (Role.GATE, Role.UP) if role == Role.GATE_UP else (Role.GATE_BIAS, Role.UP_BIAS)
            parts[names[0]], parts[names[1]] = first, second
        else:
            parts[role] = value
    return parts


def _write_back(module_params: dict[str, torch.Tensor], expert: int, parts: dict[Role, torch.Tensor],
                transposed: bool, concatenated: bool) -> None:
    gate_up = _fuse(parts[Role.GATE], parts[Role.UP], "concat" if concatenated else "interleaved")
    module_params["gate_up_proj"][expert] = gate_up.T if transposed else gate_up
    module_params["down_proj"][expert] = parts[Role.DOWN].T if transposed else parts[Role.DOWN]
    if "gate_up_proj_bias" in module_params:
        bias_layout = "concat" if concatenated else "interleaved"
        module_params["gate_up_proj_bias"][expert] = _fuse(parts[Role.GATE_BIAS], parts[Role.UP_BIAS], bias_layout)
        module_params["down_proj_bias"][expert] = parts[Role.DOWN_BIAS]


def write_tokenizer(out_dir: Path, vocab_size: int) -> list[str]:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    return sorted(Path(f).name for f in tokenizer.save_pretrained(out_dir))


def write_bundle(model: torch.nn.Module, out_dir: Path, layout: PackLayout, *, tokenizer: bool = False) -> Path:
    """Write `model` as a bundle; afterwards its expert parameters hold exactly the pack's decoded values."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    routed = {k: _ROUTED.match(k) for k in state if _ROUTED.match(k)}
    layers = sorted({int(m.group(1)) for m in routed.values()})
    first_experts = model.get_submodule(f"model.layers.{layers[0]}.mlp.experts")
    transposed, concatenated = first_experts.is_transposed, getattr(first_experts, "is_concatenated", True)
    num_experts = state[f"model.layers.{layers[0]}.mlp.experts.down_proj"].shape[0]
    writer = PackWriter(out_dir / "experts.pack", layers, num_experts, len(layout.roles))
    with torch.no_grad():
        for layer in layers:
            params = {m.group(2): state[k] for k, m in routed.items() if int(m.group(1)) == layer}
            for expert in range(num_experts):
                parts = _out_in_parts(params, expert, transposed, concatenated)
                payloads, decoded = [], {}
                for role in layout.roles:
                    value = _role_value(parts, role, layout)
                    raw, decoded[role] = _encode(value, layout.type_of(role))
                    payloads.append((role, layout.type_of(role), tuple(value.shape), raw))
                writer.add_object(layer, expert, payloads)
                _write_back(params, expert, _unparts(decoded, layout), transposed, concatenated)
    header = writer.close()
    dense = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in routed}  # untie shared
    save_file(dense, out_dir / "dense.safetensors")
    model.config.to_json_file(out_dir / "config.json")
    token_files = write_tokenizer(out_dir, model.config.vocab_size) if tokenizer else []
    manifest = {
        "format": "expertpack-bundle", "version": 1, "created_by": "tests/inference factory",
        "model_type": model.config.model_type,
        "source": {"kind": "hf", "files": []},
        "config_sha256": hashlib.sha256((out_dir / "config.json").read_bytes()).hexdigest(),
        "pack": {"file": "experts.pack", "size": header.file_size, "index_crc32": header.index_crc32,
                 "object_stride": header.object_stride},
        "dense": {"file": "dense.safetensors", "size": (out_dir / "dense.safetensors").stat().st_size,
                  "tensors": len(dense)},
        "experts": {"moe_layers": layers, "num_experts": num_experts, "top_k": model.config.num_experts_per_tok,
                    "roles": [r.name.lower() for r in layout.roles], "orientation": layout.orientation,
                    "gate_up": layout.gate_up, "element_types": sorted({layout.type_of(r).name for r in layout.roles}),
                    "bytes_total": 0},
        "tokenizer": {"files": token_files, "origin": "copied" if tokenizer else "none", "note": ""},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out_dir


NEW_TOKENS = 32


def prompt(vocab_size: int, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)


@torch.no_grad()
def compare(reference: torch.nn.Module, candidate: torch.nn.Module, label: str) -> float:
    """Greedy tokens must be identical; returns (and prints) the max relative logits error."""
    input_ids = prompt(reference.config.vocab_size).to(reference.device)
    expected_tokens = greedy(reference, input_ids)
    got_tokens = greedy(candidate, input_ids)
    assert expected_tokens.shape[1] == input_ids.shape[1] + NEW_TOKENS
    assert torch.equal(got_tokens, expected_tokens), f"{label}: greedy tokens differ"
    expected = reference(expected_tokens).logits.float()
    got = candidate(expected_tokens).logits.float()
    relative = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"{label}: {NEW_TOKENS} greedy tokens identical, max relative logits error {relative:.3e}")
    return relative


def make_case(arch: str, out_dir: Path, layout: PackLayout | None = None, *, tokenizer: bool = False,
              **model_kwargs) -> tuple[torch.nn.Module, Path]:
    """(reference model, bundle directory) holding the same weights."""
    model = make_reference_model(arch, **model_kwargs)
    return model, write_bundle(model, out_dir, layout or default_layout(arch), tokenizer=tokenizer)


# ---- the factory's own checks --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_factory_bundle_opens_and_round_trips_expert_bytes(arch, tmp_path):
    model, bundle_dir = make_case(arch, tmp_path / "b", tokenizer=True)
    with open_bundle(bundle_dir) as bundle:
        assert bundle.pack.verify_all() == []
        layer = bundle.experts["moe_layers"][0]
        entry = bundle.pack.entry(layer, 3)
        payload = bundle.pack.read_object(layer, 3)
        down = entry.role(Role.DOWN)
        stored = torch.frombuffer(bytearray(payload[down.offset:down.offset + down.nbytes]), dtype=torch.float32)
        expected = model.get_submodule(f"model.layers.{layer}.mlp.experts").down_proj[3]
        assert torch.equal(stored.reshape(down.shape), expected)  # in_out stores the param as it is


def test_factory_quantized_roles_overwrite_reference_with_decoded_values(tmp_path):
    layout = PackLayout(types=((Role.GATE, ElementType.Q8_0), (Role.UP, ElementType.Q8_0)))
    original = make_reference_model("mixtral")
    model, _ = make_case("mixtral", tmp_path / "b", layout)
    before = original.model.layers[0].mlp.experts.gate_up_proj
    after = model.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(before, after)  # quantization moved them ...
    assert torch.allclose(before, after, atol=0.02)  # ... by a Q8_0 step at most
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj, original.model.layers[0].mlp.experts.down_proj)
