"""LayerPlan with block-scaled roles: fused gate/up concatenates weights and scales row-wise,
mixed objects fall back to role-by-role dequantization, and malformed role sets are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp4_checkpoint import random_fp4, reference_dequantize
from test_model_fixtures import make_reference_model

from inference.experts.errors import ExpertLayoutError
from inference.experts.plan import build_layer_plan
from packformat import RoleEntry
from packformat.constants import ROLE_ALIGNMENT, SCALE_ROLE_OF, ElementType, Role, align_up

F4, UE8M0, F32 = ElementType.F4_E2M1X2, ElementType.UE8M0, ElementType.F32
HIDDEN, INTER = 64, 32


@pytest.fixture(scope="module")
def experts_module():
    return make_reference_model("qwen3_moe", hidden=HIDDEN, moe_intermediate=INTER).model.layers[0].mlp.experts


def _object(roles: list[tuple[Role, ElementType, tuple[int, ...], bytes]]) -> tuple[torch.Tensor, list[RoleEntry]]:
    """The bytes of one object (roles 256-aligned, as the writer lays them out) and its entries."""
    entries, blob = [], bytearray()
    for role, etype, shape, payload in roles:
        blob += b"\0" * (align_up(len(blob), ROLE_ALIGNMENT) - len(blob))
        entries.append(RoleEntry(int(role), int(etype), len(blob), len(payload), shape))
        blob += payload
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), entries


def _expert(rng, fp4_roles: set[Role]):
    """Object roles and the float32 value of every weight, for gate/up/down; FP4 where asked."""
    shapes = {Role.GATE: (INTER, HIDDEN), Role.UP: (INTER, HIDDEN), Role.DOWN: (HIDDEN, INTER)}
    weights, scales, values = [], [], {}
    for role, shape in shapes.items():
        if role in fp4_roles:
            codes, exps = random_fp4(shape, rng)
            weights.append((role, F4, shape, codes.tobytes()))
            scales.append((SCALE_ROLE_OF[role], UE8M0, exps.shape, exps.tobytes()))
            values[role] = torch.from_numpy(reference_dequantize(codes, exps))
        else:
            value = rng.standard_normal(shape).astype(np.float32)
            weights.append((role, F32, shape, value.tobytes()))
            values[role] = torch.from_numpy(value)
    return weights + scales, values


@pytest.mark.parametrize(("fp4_roles", "fused"), [
    ({Role.GATE, Role.UP, Role.DOWN}, True),  # gate+up bytes and their scales concatenated
    ({Role.GATE, Role.DOWN}, False),  # gate FP4, up F32: each role dequantized on its own
    ({Role.DOWN}, True),  # plain gate/up still byte-concatenated; only down is scaled
])
def test_materialized_weights_equal_the_reference_values(experts_module, fp4_roles, fused):
    rng = np.random.default_rng(4)
    experts = [_expert(rng, fp4_roles) for _ in range(3)]
    objects, entries = zip(*(_object(roles) for roles, _ in experts))
    plan = build_layer_plan(0, entries[0], "out_in", "concat", experts_module)
    assert (plan.fused_up is not None) == fused
    weights = plan.materialize(list(objects))
    for i, (_, values) in enumerate(experts):
        gate_up = torch.cat([values[Role.GATE], values[Role.UP]])  # [2I, H]
        got_gate_up = weights["gate_up"][i] if fused else torch.cat([weights["gate"][i], weights["up"][i]])
        assert torch.equal(got_gate_up, gate_up)
        assert torch.equal(weights["down"][i], values[Role.DOWN])


def test_fused_gate_up_role_with_its_scales(experts_module):
    rng = np.random.default_rng(5)
    codes, exps = random_fp4((2 * INTER, HIDDEN), rng)
    down_codes, down_exps = random_fp4((HIDDEN, INTER), rng)
    obj, entries = _object([(Role.GATE_UP, F4, (2 * INTER, HIDDEN), codes.tobytes()),
                            (Role.DOWN, F4, (HIDDEN, INTER), down_codes.tobytes()),
                            (Role.GATE_UP_SCALE, UE8M0, exps.shape, exps.tobytes()),
                            (Role.DOWN_SCALE, UE8M0, down_exps.shape, down_exps.tobytes())])
    weights = build_layer_plan(0, entries, "out_in", "concat", experts_module).materialize([obj])
    assert torch.equal(weights["gate_up"][0], torch.from_numpy(reference_dequantize(codes, exps)))
    assert torch.equal(weights["down"][0], torch.from_numpy(reference_dequantize(down_codes, down_exps)))


def _drop(roles, role):
    return [r for r in roles if r[0] != role]


BAD_ROLE_SETS = [
    ("FP4 without scales", lambda roles: _drop(roles, Role.UP_SCALE), "up: F4_E2M1X2 needs its up_scale role"),
    ("scales of a float weight", lambda roles: roles + [(Role.GATE_UP_SCALE, UE8M0, (64, 2), bytes(128))],
     "gate_up_scale: scales without their gate_up role"),
]


@pytest.mark.parametrize(("name", "edit", "message"), BAD_ROLE_SETS, ids=[b[0] for b in BAD_ROLE_SETS])
def test_malformed_scaled_role_sets_are_refused(experts_module, name, edit, message):
    roles, _ = _expert(np.random.default_rng(6), {Role.GATE, Role.UP, Role.DOWN})
    _, entries = _object(edit(roles))
    with pytest.raises(ExpertLayoutError, match=message):
        build_layer_plan(0, entries, "out_in", "concat", experts_module)
