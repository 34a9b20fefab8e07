"""The storage API proto: generated code is current, documented, wire-compatible, importable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from packformat import Role
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged_testkit import PYTHON, REPO

GEN_PROTO = REPO / "scripts" / "gen_proto.py"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", GEN_PROTO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def file_proto():
    (proto,) = [f for f in _gen_proto().descriptor_set().file if f.package == "expertpack.storage.v1"]
    return proto


def test_generated_code_is_current():
    result = subprocess.run([PYTHON, str(GEN_PROTO), "--check"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _documented_elements(proto):
    """(path, name) of every service, method, message, field, oneof, enum and value."""
    def message(path, msg, name):
        yield path, name
        for i, field in enumerate(msg.field):
            yield (*path, 2, i), f"{name}.{field.name}"
        for i, oneof in enumerate(msg.oneof_decl):
            if not oneof.name.startswith("_"):  # proto3 `optional` makes a synthetic oneof
                yield (*path, 8, i), f"{name}.{oneof.name}"
        for i, nested in enumerate(msg.nested_type):
            if nested.options.map_entry:  # protoc's entry type of a map field, documented by that field
                continue
            yield from message((*path, 3, i), nested, f"{name}.{nested.name}")
        for i, enum in enumerate(msg.enum_type):
            yield from enum_((*path, 4, i), enum, f"{name}.{enum.name}")

    def enum_(path, enum, name):
        yield path, name
        for i, value in enumerate(enum.value):
            yield (*path, 2, i), f"{name}.{value.name}"

    for i, msg in enumerate(proto.message_type):
        yield from message((4, i), msg, msg.name)
    for i, enum in enumerate(proto.enum_type):
        yield from enum_((5, i), enum, enum.name)
    for i, service in enumerate(proto.service):
        yield (6, i), service.name
        for j, method in enumerate(service.method):
            yield (6, i, 2, j), f"{service.name}.{method.name}"


def test_every_element_has_a_doc_comment(file_proto):
    comments = {tuple(loc.path): loc.leading_comments.strip() for loc in file_proto.source_code_info.location}
    undocumented = [name for path, name in _documented_elements(file_proto) if not comments.get(path)]
    assert not undocumented, f"elements without a leading comment: {undocumented}"


def test_enum_zero_values_are_unspecified(file_proto):
    for enum in file_proto.enum_type:
        zero = [v.name for v in enum.value if v.number == 0]
        assert zero == [f"{_screaming(enum.name)}_UNSPECIFIED"], enum.name


def _screaming(name: str) -> str:
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()


def test_roles_match_packtools_role_ids():
    for role in Role:
        assert pb.Role.Value(f"ROLE_{role.name}") == int(role)


def test_wire_lock_detects_renumbering(file_proto):
    gen = _gen_proto()
    locked = gen.wire_entries(file_proto)
    assert not gen.compatibility_problems(file_proto, locked)
    renumbered = dict(locked, **{"expertpack.storage.v1.AcquireRequest.layer": "9 TYPE_UINT32 LABEL_OPTIONAL"})
    problems = gen.compatibility_problems(file_proto, renumbered)
    assert len(problems) == 1 and "AcquireRequest.layer" in problems[0]
    removed = dict(locked, **{"expertpack.storage.v1.AcquireRequest.gone": "7 TYPE_STRING LABEL_OPTIONAL"})
    assert "without `reserved 7;`" in gen.compatibility_problems(file_proto, removed)[0]


def test_wire_lock_allows_only_varint_widenings(file_proto):
    gen = _gen_proto()
    locked = gen.wire_entries(file_proto)
    field = "expertpack.storage.v1.AcquireRequest.layer"
    assert locked[field] == "2 TYPE_UINT64 LABEL_OPTIONAL"
    # the lock of a uint32 proto: widening to uint64 reads every old value unchanged
    assert not gen.compatibility_problems(file_proto, dict(locked, **{field: "2 TYPE_UINT32 LABEL_OPTIONAL"}))
    for was in ("2 TYPE_INT32 LABEL_OPTIONAL", "2 TYPE_FIXED32 LABEL_OPTIONAL", "2 TYPE_UINT32 LABEL_REPEATED",
                "3 TYPE_UINT32 LABEL_OPTIONAL"):
        problems = gen.compatibility_problems(file_proto, dict(locked, **{field: was}))
        assert len(problems) == 1 and field in problems[0], was
    assert gen.is_widening("5 TYPE_SINT32 LABEL_REPEATED", "5 TYPE_SINT64 LABEL_REPEATED")
    assert not gen.is_widening("5 TYPE_UINT64 LABEL_OPTIONAL", "5 TYPE_UINT32 LABEL_OPTIONAL")  # narrowing


def test_generated_code_imports_without_proto_root_on_sys_path():
    code = ("import sys; from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc; "
            "assert 'expertpack' not in sys.modules, 'generated code imported the bare proto package'; "
            "print(storage_pb2_grpc.ExpertStorageStub.__name__)")
    result = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ExpertStorageStub", result.stderr


def test_pyi_stubs_are_generated():
    stub = REPO / "storaged" / "_proto" / "expertpack" / "storage" / "v1" / "storage_pb2.pyi"
    assert "class AcquireRequest(_message.Message)" in stub.read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
