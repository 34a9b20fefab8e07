"""The architecture registry: one module per architecture, each exporting one record, and the
tables that used to be kept beside it now read from it."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import gguf
import pytest

import packtools.arch.models
from packtools.arch import ARCHITECTURES, UnknownArchitectureError, get_arch, get_architecture, tiny_config
from packtools.arch.routing import check_routing
from packtools.gguf.archs import arch_for_gguf, arch_for_model_type
from packtools.synth.gguf_models import default_layers

from arch_fake import FAKE_GGUF_ARCH, register_fake_architecture

REPO = Path(__file__).resolve().parents[2]


def test_every_architecture_module_is_one_registered_record():
    modules = {m.name for m in pkgutil.iter_modules(packtools.arch.models.__path__) if not m.name.startswith("_")}
    assert modules == set(ARCHITECTURES)
    for model_type, record in ARCHITECTURES.items():
        assert record.model_type == record.spec.model_type == model_type
        assert record.gguf is None or record.gguf.model_type == model_type


def test_gguf_names_tell_every_architecture_apart():
    """Architectures sharing a GGUF arch name differ in the gating function that picks them."""
    by_name: dict[str, list] = {}
    for record in ARCHITECTURES.values():
        if record.gguf is not None:
            by_name.setdefault(record.gguf.gguf_name, []).append(record.gguf)
    for name, archs in by_name.items():
        if len(archs) > 1:
            gatings = [arch.gating_func for arch in archs]
            assert None not in gatings and len(set(gatings)) == len(archs), name
            assert sum(arch.gating_when_absent for arch in archs) <= 1, name


@pytest.fixture
def fake_arch(monkeypatch):
    return register_fake_architecture(monkeypatch)


def test_a_registered_record_is_all_the_lookups_need(fake_arch):
    config = tiny_config(fake_arch, num_layers=3)
    assert config.model_type == fake_arch and get_arch(fake_arch).moe_layers(config) == [0, 1, 2]
    check_routing(config)
    assert default_layers(fake_arch) == 2
    assert arch_for_model_type(fake_arch).gguf_name == FAKE_GGUF_ARCH
    found = arch_for_gguf("fake.gguf", FAKE_GGUF_ARCH, expert_count=8, gating_func=None)
    assert found.model_type == fake_arch


def test_a_model_type_transformers_lacks_is_refused_by_name():
    # (a type transformers knows but no module registers goes the generic path: test_generic_arch)
    with pytest.raises(UnknownArchitectureError, match="expertpack_no_such_moe.*known architectures: deepseek_v2"):
        get_architecture("expertpack_no_such_moe")


def test_deepseek2_gating_picks_the_model():
    for gating, model_type in ((gguf.ExpertGatingFuncType.SIGMOID, "deepseek_v3"),
                               (gguf.ExpertGatingFuncType.SOFTMAX, "deepseek_v2"), (None, "deepseek_v2")):
        assert arch_for_gguf("x.gguf", "deepseek2", expert_count=8, gating_func=gating).model_type == model_type


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere (under TYPE_CHECKING and inside
    functions too: a cycle deferred is still a cycle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & modules


def test_arch_and_gguf_modules_import_no_cycle():
    files = [p for package in ("arch", "gguf") for p in (REPO / "packtools" / package).rglob("*.py")]
    names = {p: ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in files}
    modules = set(names.values())
    graph = {names[p]: _module_imports(p, modules) - {names[p]} for p in files}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + (module,))}"
        if module in done:
            return
        for imported in graph[module]:
            visit(imported, path + (module,))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
