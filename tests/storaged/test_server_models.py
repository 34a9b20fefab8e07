"""Served models: bundles opened at start-up, and the slot layout Attach reports for them."""

from __future__ import annotations

import hashlib
import json

import pytest

from packformat import ElementType, PackWriter, Role
from storaged.client.layout import layers_from_proto
from storaged.server import convert
from storaged.server.models import ModelOpenError, open_models
from storaged_testkit import TEST_LAYERS, write_bundle

GATE = (Role.GATE, ElementType.Q8_0, (32, 64))
UP = (Role.UP, ElementType.Q8_0, (32, 64))
DOWN_F16 = (Role.DOWN, ElementType.F16, (64, 32))
DOWN_Q8 = (Role.DOWN, ElementType.Q8_0, (64, 32))  # a different type, size and so layout


def _mixed_bundle(path):
    """Layer 5 x 4 experts; expert 2's down projection is Q8_0 where the others are F16."""
    path.mkdir()
    writer = PackWriter(path / "experts.pack", [5], 4, 3)
    from packformat.constants import tensor_nbytes
    for expert in range(4):
        roles = (GATE, UP, DOWN_Q8 if expert == 2 else DOWN_F16)
        writer.add_object(5, expert, [(r, t, s, bytes(tensor_nbytes(t, s))) for r, t, s in roles])
    header = writer.close()
    config = json.dumps({"model_type": "qwen3_moe"}).encode()
    (path / "config.json").write_bytes(config)
    (path / "dense.safetensors").write_bytes(b"\0" * 8)
    (path / "manifest.json").write_text(json.dumps({
        "format": "expertpack-bundle", "version": 1, "model_type": "qwen3_moe",
        "config_sha256": hashlib.sha256(config).hexdigest(),
        "pack": {"size": header.file_size, "index_crc32": header.index_crc32},
        "dense": {"size": 8}, "experts": {"moe_layers": [5], "num_experts": 4}}))
    return path


def test_uniform_layers_have_no_overrides(tmp_path):
    write_bundle(tmp_path / "b")
    models = open_models({"tiny": tmp_path / "b"})
    try:
        model = models["tiny"]
        assert model.model_id == 0 and model.moe_layers == TEST_LAYERS
        assert all(layer.overrides == () for layer in model.layers)
        layout = layers_from_proto(convert.model_layout(model))
        assert [r.role for r in layout[4].object(7).roles] == [Role.GATE, Role.UP, Role.DOWN]
    finally:
        models["tiny"].close()


def test_an_expert_laid_out_differently_is_reported_per_expert(tmp_path):
    models = open_models({"mixed": _mixed_bundle(tmp_path / "mixed")})
    try:
        (layer,) = models["mixed"].layers
        assert [o.expert for o in layer.overrides] == [2]
        layout = layers_from_proto(convert.model_layout(models["mixed"]))[5]
        assert layout.object(2).role(Role.DOWN).element_type == ElementType.Q8_0
        assert layout.object(3).role(Role.DOWN).element_type == ElementType.F16
        assert layout.object(2).object_bytes != layout.object(0).object_bytes
        with pytest.raises(KeyError, match="expert 4 out of range"):
            layout.object(4)
    finally:
        models["mixed"].close()


def test_model_ids_follow_configuration_order(tmp_path):
    write_bundle(tmp_path / "a")
    write_bundle(tmp_path / "b", seed=1)
    models = open_models({"second": tmp_path / "b", "first": tmp_path / "a"})
    try:
        assert [(m.name, m.model_id) for m in models.values()] == [("second", 0), ("first", 1)]
    finally:
        for model in models.values():
            model.close()


def test_a_bad_bundle_names_the_model_and_closes_the_others(tmp_path):
    write_bundle(tmp_path / "good")
    with pytest.raises(ModelOpenError, match=r"model 'broken': .*missing: not a bundle directory"):
        open_models({"good": tmp_path / "good", "broken": tmp_path / "missing"})
