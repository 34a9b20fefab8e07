"""transformers model -> synth GGUF -> GGUFSource -> the same transformers model, for every arch.

Golden values come from outside the code under test where possible: expert bytes from gguf-py's
GGUFReader, quantized expert values from packtools.quants, llama.cpp's tensor layouts from the
formulas of its converter re-typed here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from packformat.constants import ElementType, Role
from packtools.arch import ARCHITECTURES, get_arch
from packtools.gguf.expert_map import BIAS_ROLES, hf_expert_params, hf_expert_roles
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.quants import dequantize, quantize
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf
from packtools.tokenizer_synth import build_tokenizer

from arch_fake import FAKE_GGUF_ARCH, register_fake_architecture


def gguf_archs() -> list[str]:
    """Every registered architecture packtools writes GGUFs of (the others' GGUFs come from
    llama.cpp's converter: tests/golden/llamacpp)."""
    return sorted(arch for arch, record in ARCHITECTURES.items() if record.gguf_writable)


ARCHS = gguf_archs()
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 4}  # K-quant rows: 256-element blocks
CASES = (
    [pytest.param(arch, "F32", {}, id=f"{arch}-F32") for arch in ARCHS]
    + [pytest.param(arch, "Q8_0", {}, id=f"{arch}-Q8_0") for arch in ARCHS]
    + [
        pytest.param("qwen3_moe", "Q4_K", WIDE, id="qwen3_moe-Q4_K"),
        pytest.param("deepseek_v3", "Q6_K", WIDE, id="deepseek_v3-Q6_K"),
        pytest.param("mixtral", "Q2_K", WIDE, id="mixtral-Q2_K"),
        pytest.param("kimi_linear", "Q3_K", WIDE, id="kimi_linear-Q3_K"),
        pytest.param("olmoe", "Q5_K", WIDE, id="olmoe-Q5_K"),
        pytest.param("gpt_oss", "MXFP4", {}, id="gpt_oss-MXFP4"),
        pytest.param("qwen2_moe", "BF16", {}, id="qwen2_moe-BF16"),
    ]
)
# config.to_dict() entries that do not describe the model: bookkeeping, or constructor-only input
NOT_HYPERPARAMETERS = {"dtype", "architectures", "transformers_version", "_name_or_path", "linear_attn_config"}
EXPERT_TENSOR = {
    Role.GATE: "ffn_gate_exps.weight", Role.UP: "ffn_up_exps.weight", Role.DOWN: "ffn_down_exps.weight",
    Role.GATE_BIAS: "ffn_gate_exps.bias", Role.UP_BIAS: "ffn_up_exps.bias", Role.DOWN_BIAS: "ffn_down_exps.bias",
}


@dataclasses.dataclass
class Built:
    model: PreTrainedModel
    path: Path
    source: GGUFSource
    expert_type: str


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    cache: dict = {}

    def get(arch: str, expert_type: str, sizes: dict) -> Built:
        key = (arch, expert_type, tuple(sorted(sizes.items())))
        if key not in cache:
            model = tiny_random_model(arch, seed=7, **sizes)
            tokenizer = build_tokenizer(model.config.vocab_size)
            out = tmp_path_factory.mktemp(f"{arch}-{expert_type}") / "model.gguf"
            (path,) = synth_gguf(arch, out, model=model, expert_type=expert_type, tokenizer=tokenizer)
            cache[key] = Built(model, path, GGUFSource(path), expert_type)
        return cache[key]

    yield get
    for built in cache.values():
        built.source.close()


def _moe_layers(model: PreTrainedModel) -> list[int]:
    return sorted({int(k.split(".")[2]) for k in model.state_dict() if ".mlp.experts." in k})


@pytest.mark.parametrize("arch,expert_type,sizes", CASES)
def test_config_builds_the_same_model(build, arch, expert_type, sizes):
    built = build(arch, expert_type, sizes)
    original, mapped = built.model.config.to_dict(), built.source.hf_config()
    differing = {k for k in set(original) | set(mapped) if original.get(k) != mapped.get(k)} - NOT_HYPERPARAMETERS
    assert not differing, {k: (original.get(k), mapped.get(k)) for k in differing}
    with torch.device("meta"):
        rebuilt = AutoModelForCausalLM.from_config(AutoConfig.for_model(**mapped))
    assert type(rebuilt) is type(built.model)
    shapes = {k: v.shape for k, v in built.model.state_dict().items()}
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == shapes
    assert built.source.moe_layers() == _moe_layers(built.model)
    assert built.source.num_experts() == get_arch(arch).num_experts(built.model.config)


def _with_experts_through(model: PreTrainedModel, expert_type: str) -> PreTrainedModel:
    """The original model with each expert role replaced by dequantize(quantize(role))."""
    if expert_type == "F32":
        return model
    arch, kind = model.config.model_type, ElementType[expert_type]
    state = dict(model.state_dict())
    for layer in _moe_layers(model):
        prefix = f"model.layers.{layer}.mlp.experts."
        params = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        count = params["down_proj"].shape[0]
        per_expert = [hf_expert_roles(arch, params, e) for e in range(count)]
        stacked = {}
        for role in per_expert[0]:
            role_kind = ElementType.F32 if role in (Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS) else kind
            values = [dequantize(quantize(r[role].float().numpy(), role_kind), role_kind) for r in per_expert]
            stacked[role] = torch.from_numpy(np.stack(values))
        state.update({prefix + k: v for k, v in hf_expert_params(arch, stacked).items()})
    twin = AutoModelForCausalLM.from_config(model.config)
    twin.load_state_dict(state)
    return twin.eval()


@pytest.mark.parametrize("arch,expert_type,sizes", CASES)
def test_reference_model_gives_the_same_logits(build, arch, expert_type, sizes):
    built = build(arch, expert_type, sizes)
    expected_model = _with_experts_through(built.model, expert_type)
    reference = load_reference_model(built.source)
    input_ids = torch.randint(3, built.model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = expected_model(input_ids).logits, reference(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,expert_type,sizes", CASES)
def test_expert_roles_are_the_gguf_tensor_slices(build, arch, expert_type, sizes):
    built = build(arch, expert_type, sizes)
    reader = gguf.GGUFReader(built.path)
    tensors = {t.name: t for t in reader.tensors}
    layout = built.source.expert_layout()
    with_biases = not BIAS_ROLES.isdisjoint(get_arch(arch).layout.roles)  # gpt_oss
    expected_roles = (Role.GATE, Role.UP, Role.DOWN) + ((Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS) if with_biases
                                                        else ())
    assert layout.roles == expected_roles and layout.orientation == "out_in"
    for layer in built.source.moe_layers():
        for expert in range(built.source.num_experts()):
            for role_slice in built.source.expert_roles(layer, expert):
                tensor = tensors[f"blk.{layer}.{EXPERT_TENSOR[role_slice.role]}"]
                golden = tensor.data[expert].tobytes()  # expert-major: row e of dim 0
                assert role_slice.element_type == int(tensor.tensor_type)
                assert role_slice.nbytes == len(golden) == tensor.n_bytes // built.source.num_experts()
                assert role_slice.shape == tuple(int(d) for d in reversed(tensor.shape[:-1].tolist()))
                assert bytes(role_slice.read()) == golden
    wanted = ElementType[expert_type]
    weights = [s for s in built.source.expert_roles(layer, 0) if s.role in (Role.GATE, Role.UP, Role.DOWN)]
    assert {s.element_type for s in weights} == {wanted}


@pytest.mark.parametrize("arch,expert_type,sizes", CASES)
def test_dense_tensors_equal_the_original(build, arch, expert_type, sizes):
    built = build(arch, expert_type, sizes)
    original = built.model.state_dict()
    loaded = {t.name: t for t in built.source.dense_tensors()}
    routed = {k for k in original if ".mlp.experts." in k}
    assert set(loaded) == set(original) - routed
    for name, tensor in loaded.items():
        value = tensor.load()
        assert value.dtype == tensor.dtype == torch.float32 and tuple(value.shape) == tensor.shape
        # A_log is stored as -exp(A_log), qwen3_next's (1 + weight) norms as 1 + weight: their way back
        # costs float rounding (an ulp of the stored value), everything else is exact
        if name.endswith("A_log"):
            tolerance = {"rtol": 1e-6, "atol": 1e-7}
        elif _stored_plus_one(arch, name):
            tolerance = {"rtol": 0, "atol": 2.0 ** -22}  # one ulp of values in [1, 4)
        else:
            tolerance = {"rtol": 0, "atol": 0}
        torch.testing.assert_close(value, original[name], **tolerance)


def _stored_plus_one(arch: str, name: str) -> bool:
    # llama.cpp's converter writes Qwen3-Next's zero-centred RMSNorm weights (all but the gated one) + 1
    return arch == "qwen3_next" and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_is_rebuilt_from_metadata(build, arch, tmp_path):
    built = build(arch, "F32", {})
    info = built.source.write_tokenizer(tmp_path)
    assert info["origin"] == "gguf-metadata" and "tokenizer.json" in info["files"]
    assert "may tokenize differently" not in info["note"]
    original = build_tokenizer(built.model.config.vocab_size)
    rebuilt = AutoTokenizer.from_pretrained(tmp_path)
    texts = ("The weather this morning was cold.", "print(x + y) <|im_start|>user\nhi<|im_end|>", "  spaces\tand 4096")
    for text in texts:
        assert rebuilt(text).input_ids == original(text).input_ids
    assert (rebuilt.bos_token_id, rebuilt.eos_token_id, rebuilt.pad_token_id) == (1, 2, 0)
    chat = [{"role": "user", "content": "hello"}]
    assert rebuilt.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)


@pytest.fixture
def fake_arch(monkeypatch):
    return register_fake_architecture(monkeypatch)


def test_a_registered_architecture_round_trips_like_the_others(fake_arch, build, tmp_path):
    """One record registered (arch_fake) is all the GGUF writer, reader and these checks need."""
    assert fake_arch in gguf_archs()
    for check in (test_config_builds_the_same_model, test_reference_model_gives_the_same_logits,
                  test_expert_roles_are_the_gguf_tensor_slices, test_dense_tensors_equal_the_original):
        check(build, fake_arch, "Q8_0", {})
    test_tokenizer_is_rebuilt_from_metadata(build, fake_arch, tmp_path)
    reader = gguf.GGUFReader(build(fake_arch, "Q8_0", {}).path)
    assert reader.fields["general.architecture"].contents() == FAKE_GGUF_ARCH


# kimi-k2 has its own split (packtools.tokenizers_kimi); an unknown pre falls back to GPT-2's
@pytest.mark.parametrize("pre,warned", [("qwen2", False), ("gpt-2", False), ("kimi-k2", False),
                                        ("no-such-pre", True)])
def test_tokenizer_note_flags_pre_tokenizers_transformers_lacks(tmp_path, pre, warned):
    model = tiny_random_model("olmoe", seed=1)
    tokenizer = build_tokenizer(model.config.vocab_size)
    (path,) = synth_gguf("olmoe", tmp_path / "m.gguf", model=model, tokenizer=tokenizer, tokenizer_pre=pre)
    with GGUFSource(path) as source:
        info = source.write_tokenizer(tmp_path / "tok")
    assert info["origin"] == "gguf-metadata"
    assert ("may tokenize differently" in info["note"]) == warned
