"""verify_hits: the share of cache hits re-checked against their checksum, from TOML and the CLI."""

from __future__ import annotations

import pytest

from storaged.cli import build_parser, config_from_args, main
from storaged.config import ConfigError, StoragedConfig


@pytest.mark.parametrize("value, expected", [(0, 0.0), (0.0, 0.0), (0.01, 0.01), (0.5, 0.5), (1, 1.0), (1.0, 1.0)])
def test_accepted(tmp_path, value, expected):
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, verify_hits=value)
    assert config.verify_hits == expected and isinstance(config.verify_hits, float)


def test_off_by_default(tmp_path):
    assert StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1).verify_hits == 0.0


@pytest.mark.parametrize("fields, problem", [
    ({"verify_hits": -0.1}, r"from 0 \(off\) to 1.0"),
    ({"verify_hits": 1.5}, r"from 0 \(off\) to 1.0"),
    ({"verify_hits": 2}, r"from 0 \(off\) to 1.0"),
    ({"verify_hits": float("nan")}, r"from 0 \(off\) to 1.0"),
    ({"verify_hits": True}, r"from 0 \(off\) to 1.0"),  # not a share: say 1.0
    ({"verify_hits": "always"}, r"from 0 \(off\) to 1.0"),
    ({"verify_hits": 0.5, "verify_checksums": False}, "needs verify_checksums = true"),
    ({"verify_hits": 1.0, "verify_checksums": False}, "needs verify_checksums = true"),
])
def test_refused_naming_the_field(tmp_path, fields, problem):
    with pytest.raises(ConfigError, match=problem) as info:
        StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, **fields)
    assert info.value.field == "verify_hits"


def test_off_needs_no_checksums(tmp_path):
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, verify_hits=0, verify_checksums=False)
    assert config.verify_hits == 0.0


def test_toml_then_cli(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text('vram_cache_bytes = 1\nverify_hits = 0.25\n[models]\nm = "/x"\n')
    assert config_from_args(build_parser().parse_args(["--config", str(toml)])).verify_hits == 0.25
    args = build_parser().parse_args(["--config", str(toml), "--verify-hits", "1.0"])
    assert config_from_args(args).verify_hits == 1.0


def test_cli_refusal_exits_2_naming_it(tmp_path, capsys):
    assert main(["--model", f"m={tmp_path}", "--vram-cache-bytes", "1", "--verify-hits", "3"]) == 2
    assert "verify_hits" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--verify-hits", "often"])
