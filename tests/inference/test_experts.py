"""The expertpack experts forward, module by module, against transformers' eager experts forward.

With top_k = 4 the order in which a token's expert outputs are summed matters in float32; the
expertpack forward must reproduce eager's (ascending expert id, starting from zero) bit for bit
whenever the pack keeps the module's own orientation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_fixtures import GGUF_GPT_OSS_ROLES, PackLayout, default_layout, make_case

from inference.experts import (
    ExpertLayoutError,
    ExpertSourceError,
    LocalPackSource,
    RoutingError,
    UnboundExpertsError,
    bind_experts,
    build_layer_plan,
    experts_modules,
    select_expertpack,
)
from inference.model import build_meta_model, load_model
from packformat import ElementType, ObjectChecksumError, PackWriter, Role, RoleEntry
from packformat.bundle import open_bundle
from packtools.arch.registry import tiny_config

TOP_K = 4
TOKENS = 37

# name: (arch, layout, exact) — exact when the pack keeps the module's orientation
LAYOUTS = {
    "split gate/up F32": ("qwen3_moe", PackLayout(), True),
    "fused gate_up concat": ("mixtral", PackLayout((Role.GATE_UP, Role.DOWN)), True),
    "fused gate_up interleaved for a concat module": (
        "olmoe", PackLayout((Role.GATE_UP, Role.DOWN), gate_up="interleaved"), True),
    "split gate Q8_0 / up F32 (no byte fusion)": (
        "deepseek_v3", PackLayout(types=((Role.GATE, ElementType.Q8_0),)), True),
    "gpt_oss transformers layout": ("gpt_oss", default_layout("gpt_oss"), True),
    "gpt_oss split out_in (GGUF)": ("gpt_oss", PackLayout(GGUF_GPT_OSS_ROLES), False),
    "gpt_oss split in_out": ("gpt_oss", PackLayout(GGUF_GPT_OSS_ROLES, orientation="in_out"), True),
    "deepseek_v4 clamped SwiGLU": ("deepseek_v4", PackLayout(), True),
}


pytestmark = pytest.mark.usefixtures("one_thread")


class RecordingSource:
    """A real LocalPackSource that also records every acquire."""

    def __init__(self, bundle, device):
        self.inner = LocalPackSource(bundle, device)
        self.calls: list[tuple[int, list[int]]] = []

    def layout(self, layer):
        return self.inner.layout(layer)

    def acquire(self, layer, experts):
        self.calls.append((layer, list(experts)))
        return self.inner.acquire(layer, experts)


def routing(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=generator)
    return index, weights


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_equals_eager_forward(name, tmp_path):
    arch, layout, exact = LAYOUTS[name]
    reference, bundle_dir = make_case(arch, tmp_path / "b", layout, top_k=TOP_K)
    reference.set_experts_implementation("eager")
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=RecordingSource) as loaded:
        ours = experts_modules(loaded.model)
        for layer, (module_name, module) in experts_modules(reference).items():
            hidden = torch.randn(TOKENS, module.down_proj.shape[-1 if module.is_transposed else 1],
                                 generator=torch.Generator().manual_seed(layer))
            index, weights = routing(8, seed=layer)
            with torch.no_grad():
                expected = module(hidden, index, weights)
                got = ours[layer][1](hidden, index, weights)
            assert loaded.expert_source.calls[-1] == (layer, sorted(set(index.flatten().tolist())))
            if exact:
                assert torch.equal(got, expected), f"{name}, {module_name}: max diff {(got - expected).abs().max()}"
            else:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["split gate/up F32", "gpt_oss transformers layout", "gpt_oss split out_in (GGUF)",
                                  "fused gate_up interleaved for a concat module"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_one_pair_per_expert_runs_batched_and_matches_eager(name, tokens, tmp_path):
    """Decode-shaped routing (all experts distinct) takes the batched path: bmm instead of F.linear."""
    arch, layout, _ = LAYOUTS[name]
    reference, bundle_dir = make_case(arch, tmp_path / "b", layout, top_k=TOP_K)
    reference.set_experts_implementation("eager")
    module = experts_modules(reference)[1][1]
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2))
    index = torch.randperm(8, generator=torch.Generator().manual_seed(3))[: tokens * TOP_K].view(tokens, TOP_K)
    weights = torch.rand(tokens, TOP_K, generator=torch.Generator().manual_seed(4))
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        with torch.no_grad():
            got = experts_modules(loaded.model)[1][1](hidden, index, weights)
            expected = module(hidden, index, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert got.abs().max() > 0.1  # the experts did contribute


def test_summation_order_is_what_makes_it_exact(tmp_path):
    """Control: summing a token's experts in slot order instead of expert order is not bit-equal."""
    reference, bundle_dir = make_case("qwen3_moe", tmp_path / "b", top_k=TOP_K)
    reference.set_experts_implementation("eager")
    module = reference.model.layers[0].mlp.experts
    hidden = torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(5))
    index, weights = routing(8, seed=5)
    with torch.no_grad():
        expected = module(hidden, index, weights)
        per_slot = [module(hidden, index[:, [j]], weights[:, [j]]) for j in range(TOP_K)]
    slot_order = sum(per_slot[1:], per_slot[0])
    assert not torch.equal(slot_order, expected)


def test_hash_routed_layer_acquires_tid2eid_experts(tmp_path):
    reference, bundle_dir = make_case("deepseek_v4", tmp_path / "b")
    input_ids = torch.tensor([[5, 9, 300, 5, 77]])
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=RecordingSource) as loaded:
        with torch.no_grad():
            loaded.model(input_ids)
        tid2eid = loaded.model.model.layers[0].mlp.gate.tid2eid
        first_layer_calls = [experts for layer, experts in loaded.expert_source.calls if layer == 0]
        assert first_layer_calls == [sorted(set(tid2eid[input_ids.flatten()].flatten().tolist()))]


def test_router_ids_outside_the_layer_are_refused(tmp_path):
    _, bundle_dir = make_case("mixtral", tmp_path / "b")
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        module = experts_modules(loaded.model)[1][1]
        with pytest.raises(RoutingError, match="layer 1: router selected expert 8"):
            module(torch.zeros(2, 64), torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2))
        empty = module(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
        assert empty.shape == (0, 64)


def test_unbound_module_is_refused():
    model = build_meta_model(tiny_config("qwen3_moe"), torch.float32)
    select_expertpack(model)
    with pytest.raises(UnboundExpertsError, match="Qwen3MoeExperts"):
        model.model.layers[0].mlp.experts(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))


def test_corrupted_object_fails_its_checksum_on_acquire(tmp_path):
    _, bundle_dir = make_case("qwen3_moe", tmp_path / "b")
    with open_bundle(bundle_dir) as bundle:
        entry = bundle.pack.entry(1, 6)
    with open(bundle_dir / "experts.pack", "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        module = experts_modules(loaded.model)[1][1]
        module(torch.ones(1, 64), torch.tensor([[5, 7]]), torch.ones(1, 2))  # intact experts still work
        with pytest.raises(ObjectChecksumError):
            module(torch.ones(1, 64), torch.tensor([[6, 7]]), torch.ones(1, 2))


class ShortSource(RecordingSource):
    def acquire(self, layer, experts):
        return super().acquire(layer, experts)[:-1]


def test_source_returning_too_few_objects_is_refused(tmp_path):
    _, bundle_dir = make_case("olmoe", tmp_path / "b")
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=ShortSource) as loaded:
        with pytest.raises(ExpertSourceError, match=r"asked for 2 experts \[1, 3\], got 1"):
            experts_modules(loaded.model)[0][1](torch.ones(1, 64), torch.tensor([[3, 1]]), torch.ones(1, 2))


def _roles(*specs) -> list[RoleEntry]:
    return [RoleEntry(int(role), int(ElementType.F32), 0, 4 * int(torch.tensor(shape).prod()), shape)
            for role, shape in specs]


SWIGLU_OK = ((Role.GATE, (32, 64)), (Role.UP, (32, 64)), (Role.DOWN, (64, 32)))
LAYOUT_ERRORS = [
    # (arch, roles, orientation, gate_up, message)
    ("qwen3_moe", _roles((Role.GATE, (16, 64)), (Role.UP, (32, 64)), (Role.DOWN, (64, 32))), "out_in", "concat",
     r"role GATE has shape \(16, 64\).*needs \(32, 64\)"),
    ("qwen3_moe", _roles(*SWIGLU_OK), "in_out", "concat", r"role GATE has shape \(32, 64\).*needs \(64, 32\)"),
    ("qwen3_moe", _roles((Role.GATE, (32, 64)), (Role.DOWN, (64, 32))), "out_in", "concat", "do not fit"),
    ("gpt_oss", _roles(*SWIGLU_OK), "out_in", "concat", r"do not fit.*has_bias=True"),
    ("qwen3_moe", _roles(*SWIGLU_OK, (Role.DOWN_BIAS, (64,))), "out_in", "concat", "do not fit"),
    ("qwen3_moe", _roles(*SWIGLU_OK, (Role.UP, (32, 64))), "out_in", "concat", "role UP appears twice"),
    ("qwen3_moe", _roles(*SWIGLU_OK), "rows", "concat", "unknown orientation 'rows'"),
    ("qwen3_moe", _roles(*SWIGLU_OK), "out_in", "zigzag", "unknown gate_up layout 'zigzag'"),
]


@pytest.mark.parametrize(("arch", "roles", "orientation", "gate_up", "message"), LAYOUT_ERRORS)
def test_layouts_that_do_not_fit_the_module_are_refused(arch, roles, orientation, gate_up, message):
    model = build_meta_model(tiny_config(arch), torch.float32)
    module = experts_modules(model)[1][1]
    with pytest.raises(ExpertLayoutError, match="layer 3: .*" + message):
        build_layer_plan(3, roles, orientation, gate_up, module)


def test_bundle_layers_must_match_the_model(tmp_path):
    _, bundle_dir = make_case("qwen3_moe", tmp_path / "b")
    model = build_meta_model(tiny_config("qwen3_moe"), torch.float32)
    with open_bundle(bundle_dir) as bundle:
        source = LocalPackSource(bundle, "cpu")
        with pytest.raises(ExpertLayoutError, match=r"layers \[0, 1\], the bundle in \[1\]"):
            bind_experts(model, source, moe_layers=[1], num_experts=8, orientation="out_in", gate_up_layout="concat")
        with pytest.raises(ExpertLayoutError, match="the model has 8 experts, the bundle 16"):
            bind_experts(model, source, moe_layers=[0, 1], num_experts=16, orientation="out_in",
                         gate_up_layout="concat")


def test_a_layer_whose_experts_differ_in_layout_is_refused(tmp_path):
    writer = PackWriter(tmp_path / "p.pack", [0], 2, 1)
    for expert, etype in enumerate([ElementType.F32, ElementType.BF16]):
        size = 4 if etype == ElementType.F32 else 2
        writer.add_object(0, expert, [(Role.DOWN, etype, (4, 8), bytes(32 * size))])
    writer.close()

    @dataclasses.dataclass
    class PackOnly:  # uniform_layout reads only bundle.pack
        pack: object

    from packformat import PackReader
    with PackReader(tmp_path / "p.pack") as reader:
        with pytest.raises(ExpertLayoutError, match="layer 0: expert 1's roles .* differ from expert 0's"):
            LocalPackSource(PackOnly(reader), "cpu").layout(0)
