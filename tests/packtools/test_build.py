"""build_bundle end to end: every architecture from Hugging Face and from GGUF, checked byte for byte.

Golden values are read independently of packtools' sources: HF expert bytes with
safetensors.safe_open and a name table written out here, dense weights from transformers'
from_pretrained; GGUF expert bytes with gguf.GGUFReader, dense weights from the model the GGUF
was written from (or, for a hand-written GGUF, the GGUF reference model).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from packformat.bundle import open_bundle
from packformat.constants import ElementType, Role
from packtools.arch import ARCHITECTURES, get_arch
from packtools.build import build_bundle
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.inspect import validate
from packtools.synth.gguf_cli import synth_gguf_model
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.hf import synth_hf
from packtools.tokenizer_synth import build_tokenizer

from arch_fake import register_fake_architecture
from gguf_handmade import Q, handmade_kv, handmade_tensors, write_handmade

REPO = Path(__file__).resolve().parents[2]


def hf_archs() -> list[str]:
    """Every registered architecture: each builds from a Hugging Face checkpoint."""
    return sorted(ARCHITECTURES)


def gguf_archs() -> list[str]:
    """Every registered architecture packtools writes GGUFs of (the others' GGUFs come from
    llama.cpp's converter: tests/golden/llamacpp)."""
    return sorted(arch for arch, record in ARCHITECTURES.items() if record.gguf_writable)


# (arch, dtype, how the checkpoint is laid out)
HF_CASES = [pytest.param(arch, "bfloat16", "single", id=f"hf-{arch}") for arch in hf_archs()] + [
    pytest.param("qwen3_moe", "float16", "sharded", id="hf-qwen3_moe-f16-sharded"),
    pytest.param("deepseek_v4", "float32", "sharded", id="hf-deepseek_v4-f32-sharded"),
    pytest.param("gpt_oss", "bfloat16", "sharded", id="hf-gpt_oss-sharded"),
    pytest.param("mixtral", "bfloat16", "fused", id="hf-mixtral-fused"),
]
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 4}  # K-quant rows: 256-element blocks
NARROW = {"num_experts": 4}
# the expert type each GGUF arch is built with here, so that every type is built at least once;
# an architecture not listed gets Q8_0
GGUF_EXPERT_TYPE = {
    "qwen3_moe": ("Q4_K", WIDE),
    "qwen2_moe": ("Q5_K", WIDE),
    "mixtral": ("Q2_K", WIDE),
    "olmoe": ("Q6_K", WIDE),
    "deepseek_v3": ("Q3_K", WIDE),
    "deepseek_v2": ("Q5_0", NARROW),
    "kimi_linear": ("Q8_0", NARROW),
    "gpt_oss": ("MXFP4", NARROW),
}
# (arch, expert type, sizes, split_max_tensors): every GGUF arch, every expert type at least once
GGUF_CASES = [
    pytest.param(arch, *GGUF_EXPERT_TYPE.get(arch, ("Q8_0", NARROW)), None,
                 id=f"gguf-{arch}-{GGUF_EXPERT_TYPE.get(arch, ('Q8_0',))[0]}")
    for arch in gguf_archs()
] + [
    pytest.param("qwen3_moe", "F16", NARROW, 7, id="gguf-qwen3_moe-F16-split"),
    pytest.param("olmoe", "BF16", NARROW, None, id="gguf-olmoe-BF16"),
    pytest.param("mixtral", "F32", NARROW, None, id="gguf-mixtral-F32"),
    pytest.param("deepseek_v3", "Q4_0", NARROW, None, id="gguf-deepseek_v3-Q4_0"),
]

# ---- golden expert bytes, from the source files directly ----
# kimi_k3's official layout nests the text model under "language_model."
HF_PER_EXPERT = re.compile(
    r"^(?:language_model\.)?model\.layers\.(\d+)\.(?:mlp|block_sparse_moe|ffn)\.experts\.(\d+)\.(\w+)\.weight$"
)
HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")
HF_PROJ = {"gate_proj": Role.GATE, "w1": Role.GATE, "up_proj": Role.UP, "w3": Role.UP,
           "down_proj": Role.DOWN, "w2": Role.DOWN}
IN_OUT_FUSED = {"gate_up_proj": Role.GATE_UP, "down_proj": Role.DOWN,
                 "gate_up_proj_bias": Role.GATE_UP_BIAS, "down_proj_bias": Role.DOWN_BIAS}
TORCH_TYPE = {torch.bfloat16: ElementType.BF16, torch.float16: ElementType.F16, torch.float32: ElementType.F32}
GGUF_ROLE_TENSOR = {Role.GATE: "ffn_gate_exps.weight", Role.UP: "ffn_up_exps.weight",
                    Role.DOWN: "ffn_down_exps.weight", Role.GATE_BIAS: "ffn_gate_exps.bias",
                    Role.UP_BIAS: "ffn_up_exps.bias", Role.DOWN_BIAS: "ffn_down_exps.bias"}

Golden = dict[tuple[int, int, Role], tuple[int, tuple[int, ...], bytes]]  # (L, E, role) -> (type, shape, bytes)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def hf_golden(directory: Path, model_type: str) -> Golden:
    golden: Golden = {}

    def put(layer, expert, role, tensor):
        golden[int(layer), int(expert), role] = (TORCH_TYPE[tensor.dtype], tuple(tensor.shape), raw(tensor))

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if match := HF_PER_EXPERT.match(name):
                    put(match[1], match[2], HF_PROJ[match[3]], f.get_tensor(name))
                elif match := HF_FUSED.match(name):
                    fused = f.get_tensor(name)  # [E, ...]
                    for expert in range(fused.shape[0]):
                        if get_arch(model_type).layout.orientation == "in_out":  # gpt_oss: kept whole
                            put(match[1], expert, IN_OUT_FUSED[match[2]], fused[expert])
                        elif match[2] == "down_proj":
                            put(match[1], expert, Role.DOWN, fused[expert])
                        else:  # gate_up_proj [E, 2I, H]: gate rows first
                            inter = fused.shape[1] // 2
                            put(match[1], expert, Role.GATE, fused[expert, :inter])
                            put(match[1], expert, Role.UP, fused[expert, inter:])
    return golden


def gguf_golden(files: list[Path]) -> Golden:
    golden: Golden = {}
    for file in files:
        for tensor in gguf.GGUFReader(file).tensors:
            match = re.match(r"^blk\.(\d+)\.(.+)$", tensor.name)
            role = next((r for r, n in GGUF_ROLE_TENSOR.items() if match and match[2] == n), None)
            if role is None:
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape[:-1].tolist()))  # one expert, numpy order
            for expert in range(tensor.data.shape[0]):
                golden[int(match[1]), expert, role] = (int(tensor.tensor_type), shape, tensor.data[expert].tobytes())
    return golden


def assert_pack_matches(bundle_dir: Path, golden: Golden) -> None:
    """Every role of every object equals the source slice; nothing missing, nothing extra."""
    with open_bundle(bundle_dir) as bundle:
        assert list(bundle.pack.layers) == sorted({layer for layer, _, _ in golden})
        seen = set()
        for obj in bundle.pack:
            payload = bundle.pack.read_object(obj.layer, obj.expert)  # checksum-verified
            for role in obj.roles:
                key = (obj.layer, obj.expert, Role(role.role))
                element_type, shape, expected = golden[key]
                assert (role.element_type, role.shape) == (element_type, shape), key
                assert payload[role.offset:role.offset + role.nbytes] == expected, key
                seen.add(key)
        assert seen == set(golden)


def routed(name: str) -> bool:
    return ".mlp.experts." in name


def assert_dense_matches(bundle_dir: Path, state: dict[str, torch.Tensor], tied: set[str], *,
                         loose: tuple[str, ...] = ()) -> None:
    dense = load_file(bundle_dir / "dense.safetensors")
    expected = {k for k in state if not routed(k)}
    assert expected - tied <= set(dense) <= expected
    for name, value in dense.items():
        if state[name].dtype == torch.float32 and value.dtype in (torch.bfloat16, torch.float16):
            # the bundle keeps the checkpoint's bytes, and transformers loads the tensors it keeps in
            # float32 (_keep_in_fp32_modules*) upcast; 5.17's from_config builds those in the model's
            # dtype, so a checkpoint synthesized there holds them in bf16: the upcast must be exact
            value = value.float()
        tolerance = {"rtol": 1e-6, "atol": 1e-7} if name.endswith(loose) else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(value, state[name], **tolerance, msg=name)


def tied_keys(model) -> set[str]:
    return set(getattr(model, "all_tied_weights_keys", {}) or {})


def write_fused_checkpoint(arch: str, out: Path) -> Path:
    """A HF directory with the runtime (fused 3-D) parameter names, as some exporters write."""
    model = tiny_random_model(arch, seed=5, num_experts=4)
    out.mkdir()
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k not in tied_keys(model)}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out)
    return out


def make_hf(arch: str, dtype: str, layout: str, root: Path) -> Path:
    if layout == "fused":
        return write_fused_checkpoint(arch, root / "fused")
    streamed = {"stream_threshold_bytes": 0, "max_shard_bytes": 16 * 1024} if layout == "sharded" else {}
    return synth_hf(arch, root / "hf", seed=3, dtype=dtype, num_experts=4, **streamed).out_dir


@pytest.mark.parametrize("arch,dtype,layout", HF_CASES)
def test_hf_build(tmp_path, arch, dtype, layout):
    source = make_hf(arch, dtype, layout, tmp_path)
    if layout == "sharded":
        assert (source / "model.safetensors.index.json").is_file() and len(list(source.glob("*.safetensors"))) > 2
    report = build_bundle(source, tmp_path / "bundle", progress=False)
    bundle = tmp_path / "bundle"
    assert report.bundle == bundle and validate(bundle, full=True).ok
    golden = hf_golden(source, arch)
    assert_pack_matches(bundle, golden)
    payload = sum(len(b) for _, _, b in golden.values())
    assert payload <= report.expert_bytes < payload + 256 * len(golden)  # roles start 256-aligned in an object
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    assert_dense_matches(bundle, model.state_dict(), tied_keys(model))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "hf" and manifest["model_type"] == arch
    assert manifest["experts"]["num_experts"] == 4
    assert json.loads((bundle / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    if layout == "fused":
        assert manifest["tokenizer"]["files"] == []
    else:
        assert (bundle / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch,expert_type,sizes,split", GGUF_CASES)
def test_gguf_build(tmp_path, arch, expert_type, sizes, split):
    files = synth_gguf_model(arch, tmp_path / "model.gguf", seed=11, expert_type=expert_type,
                             split_max_tensors=split, **sizes)
    assert (len(files) > 1) == (split is not None)
    bundle = tmp_path / "bundle"
    build_bundle(files[0], bundle, progress=False)
    assert validate(bundle, full=True).ok
    assert_pack_matches(bundle, gguf_golden(files))
    manifest = json.loads((bundle / "manifest.json").read_text())
    weight_types = {ElementType[expert_type].name}
    assert set(manifest["experts"]["element_types"]) - {"F32"} == weight_types - {"F32"}
    assert [f["name"] for f in manifest["source"]["files"]] == [f.name for f in files]

    # the model the GGUF was written from is the golden for dense weights and for the config
    original = tiny_random_model(arch, seed=11, **sizes)
    # A_log and qwen3_next's (1 + weight) norms are stored transformed: their way back costs rounding
    loose = ("A_log",) + (("layernorm.weight", "_norm.weight", "model.norm.weight") if arch == "qwen3_next" else ())
    assert_dense_matches(bundle, original.state_dict(), tied_keys(original), loose=loose)
    config = json.loads((bundle / "config.json").read_text())
    with torch.device("meta"):
        rebuilt = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert type(rebuilt) is type(original)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in original.state_dict().items()}

    assert manifest["tokenizer"]["origin"] == "gguf-metadata"
    text = "The weather <|im_start|>user\nhi<|im_end|> 4096"
    expected_ids = build_tokenizer(original.config.vocab_size)(text).input_ids
    assert AutoTokenizer.from_pretrained(bundle)(text).input_ids == expected_ids


@pytest.fixture
def fake_arch(monkeypatch):
    return register_fake_architecture(monkeypatch)


def test_a_registered_architecture_builds_like_the_others(fake_arch, tmp_path):
    """One record registered (arch_fake) is all the build and these checks need."""
    assert fake_arch in hf_archs() and fake_arch in gguf_archs()
    for part in ("hf", "gguf"):
        (tmp_path / part).mkdir()
    test_hf_build(tmp_path / "hf", fake_arch, "bfloat16", "single")
    test_gguf_build(tmp_path / "gguf", fake_arch, "Q8_0", NARROW, None)
    manifest = json.loads((tmp_path / "gguf" / "bundle" / "manifest.json").read_text())
    assert manifest["model_type"] == fake_arch


def test_handmade_gguf_builds_and_validates(tmp_path):
    """A GGUF written straight through gguf-py's GGUFWriter, not by our synth, and with no tokenizer."""
    path = write_handmade(tmp_path / "hand.gguf", handmade_kv(), handmade_tensors(Q.Q4_0, seed=4))
    bundle = tmp_path / "bundle"
    report = build_bundle(path, bundle, progress=False)
    assert report.objects == 2 * 4
    result = validate(bundle, full=True)
    assert result.ok and result.objects == 8
    assert_pack_matches(bundle, gguf_golden([path]))
    with GGUFSource(path) as source:
        reference = load_reference_model(source)
    assert_dense_matches(bundle, reference.state_dict(), tied_keys(reference))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["tokenizer"]["origin"] == "none" and "no tokenizer.ggml.model" in manifest["tokenizer"]["note"]
    assert not list(bundle.glob("tokenizer*"))


# ---- bounded memory: peak RSS must not grow with the dense bytes either ----
# Runs the CLI and reports the child's own peak RSS. Not ru_maxrss from wait4: Linux carries
# ru_maxrss across exec, so a child of this (large) pytest process would report pytest's size.
MEASURED_BUILD = """
import sys
from packtools.cli import main
code = main(sys.argv[1:])
peak_kb = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]
print("VmHWM", int(peak_kb) * 1024)
sys.exit(code)
"""


def build_peak_rss(source: Path, out: Path) -> int:
    """Peak RSS (bytes) of a `packtools build` process; page cache that is not mapped is not in it."""
    run = subprocess.run([sys.executable, "-c", MEASURED_BUILD, "build", str(source), "-o", str(out), "--quiet"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split("VmHWM ")[1])


def dense_bytes(bundle: Path) -> int:
    return (bundle / "dense.safetensors").stat().st_size


def synth_layers(fmt: str, layers: int, where: Path) -> Path:
    sizes = dict(hidden_size=1024, moe_intermediate_size=256, num_experts=4, num_layers=layers)
    if fmt == "gguf":  # dense tensors stay F32 in the GGUF: ~12.6 MB of attention per layer
        return synth_gguf_model("qwen3_moe", where / f"{layers}.gguf", seed=0, expert_type="Q8_0", **sizes)[0]
    return synth_hf("qwen3_moe", where / f"hf{layers}", seed=0, dtype="bfloat16", **sizes).out_dir


@pytest.mark.slow  # synthesizes and builds two models of 14-26 layers per case: 25-30 s
@pytest.mark.parametrize("fmt,layers", [("gguf", 14), ("hf", 26)])
def test_dense_weights_do_not_accumulate_in_rss(tmp_path, fmt, layers):
    """Two models alike but for ~150 MB more dense weights (more layers; the largest tensor is
    4 MB in both): the build holds one dense tensor at a time, so its peak RSS must not grow
    by anything like the dense bytes. Reading dense tensors through a memory map that stays
    open (gguf-py's GGUFReader, safetensors' safe_open) leaves every page read resident in
    the process, so RSS grows by the whole dense size."""
    light, heavy = synth_layers(fmt, 2, tmp_path), synth_layers(fmt, layers, tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:  # each measures only its own process
        light_rss, heavy_rss = pool.map(build_peak_rss, (light, heavy), (tmp_path / "light", tmp_path / "heavy"))
    more_dense = dense_bytes(tmp_path / "heavy") - dense_bytes(tmp_path / "light")
    assert more_dense > 140e6
    assert heavy_rss - light_rss < more_dense / 4, (
        f"peak RSS grew by {(heavy_rss - light_rss) / 2**20:.0f} MiB for {more_dense / 2**20:.0f} MiB more dense")
