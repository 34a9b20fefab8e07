"""`inference generate`: the same tokens as the engine, streamed to stdout, and clear refusals."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import sys

import pytest
import torch
from test_engine_fixtures import loaded, qwen_bundle, tiny_bundle  # noqa: F401  (fixtures)
from test_server_fixtures import REPO

from inference.cli import build_parser, generate_config_from_args, main, serve_config_from_args
from inference.config import (ConfigError, ExpertSourceNotAvailableError, GenerateConfig, ModelConfig, ServeConfig,
                              make_expert_source)
from inference.engine import ModelRunner, SamplingParams, encode_chat, encode_completion_prompt
from inference.engine.timed_source import TimedExpertSource
from inference.experts import LocalPackSource
from inference.experts.cpu_experts import CpuExpertsConfig

PROMPT = "The old library on the hill"
pytestmark = pytest.mark.usefixtures("one_thread")


def generate_args(bundle, *extra: str) -> list[str]:
    return ["generate", "--bundle", str(bundle), "--dtype", "float32", "--local", "--prompt", PROMPT, *extra]


def engine_text(loaded, prompt_ids, **params) -> str:
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(2,), context_length=None)
    return runner.run(prompt_ids, SamplingParams(**params), emit=lambda d: None).text


def test_generate_prints_the_engines_greedy_text(qwen_bundle, loaded, capsys):
    assert main(generate_args(qwen_bundle, "--max-tokens", "12")) == 0
    out, err = capsys.readouterr()
    expected = engine_text(loaded, encode_completion_prompt(loaded.tokenizer, PROMPT), max_tokens=12, temperature=0)
    assert out == expected + "\n"
    assert "finish_reason=length" in err and "completion_tokens=12" in err


def test_generate_chat_seed_and_stop(qwen_bundle, loaded, capsys):
    chat_ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    args = ["--chat", "--max-tokens", "10", "--temperature", "0.9", "--top-p", "0.8", "--seed", "21"]
    assert main(generate_args(qwen_bundle, *args)) == 0
    sampled = capsys.readouterr().out
    assert sampled == engine_text(loaded, chat_ids, max_tokens=10, temperature=0.9, top_p=0.8, seed=21) + "\n"

    full = engine_text(loaded, chat_ids, max_tokens=20, temperature=0)
    stop = full[6:8]
    assert main(generate_args(qwen_bundle, "--chat", "--max-tokens", "20", "--stop", stop)) == 0
    out, err = capsys.readouterr()
    assert out == full[:full.index(stop)] + "\n" and "finish_reason=stop" in err


def test_generate_refuses_lookahead_without_a_source_that_takes_hints(qwen_bundle, capsys):
    assert main(generate_args(qwen_bundle, "--lookahead", "4")) == 1  # the local pack source
    assert "takes no prefetch hints" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--top-p", "0"], "top_p must be a number in (0, 1]"),
    (["--temperature", "3"], "temperature must be a number in [0, 2]"),
    (["--max-tokens", "5000"], "exceed this model's context"),
])
def test_generate_refuses_bad_settings(qwen_bundle, capsys, extra, message):
    assert main(generate_args(qwen_bundle, *extra)) == 2
    assert message in capsys.readouterr().err


def test_storaged_is_selectable_but_says_it_is_not_available(qwen_bundle, loaded, capsys):
    assert main(["generate", "--bundle", str(qwen_bundle), "--prompt", "x", "--storaged", "/run/s.sock"]) == 2
    assert "storaged expert source is not available" in capsys.readouterr().err
    config = serve_config_from_args(build_parser().parse_args(["serve", "--bundle", str(qwen_bundle), "--storaged",
                                                                "/run/s.sock"]))
    with pytest.raises(ExpertSourceNotAvailableError, match="/run/s.sock"):
        make_expert_source(config.model, loaded.bundle)
    local_config = serve_config_from_args(build_parser().parse_args(["serve", "--bundle", str(qwen_bundle)]))
    local = make_expert_source(local_config.model, loaded.bundle)
    assert isinstance(local, TimedExpertSource) and isinstance(local.source, LocalPackSource)
    assert local.source.device == torch.device("cpu")


def test_local_and_storaged_are_exclusive(qwen_bundle, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "--bundle", str(qwen_bundle), "--prompt", "x", "--local",
                                   "--storaged", "s.sock"])
    assert exit_.value.code == 2


def test_generate_reads_the_prompt_from_stdin(qwen_bundle, loaded, capsys, monkeypatch):
    # in this process: `python -m inference` itself is what every server test's ServerProcess runs
    args = generate_args(qwen_bundle, "--max-tokens", "6")
    args[args.index(PROMPT)] = "-"
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    assert main(args) == 0
    expected = engine_text(loaded, encode_completion_prompt(loaded.tokenizer, PROMPT), max_tokens=6, temperature=0)
    assert capsys.readouterr().out == expected + "\n"


# --- serve's configuration: TOML file, flags over it, checked before anything loads ----------

def serve_config(*argv: str) -> ServeConfig:
    return serve_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_config_from_a_file_with_flags_over_it(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERENCE_API_KEY", raising=False)
    (tmp_path / "keys").write_text("from-file\n")
    (tmp_path / "inference.toml").write_text(
        'bundle = "bundles/qwen"\nstoraged = "/run/expertpack/storaged.sock"\nport = 8100\nmax_tokens = 512\n'
        'max_queue = 0\nrequest_timeout = 600\napi_key_file = "keys"\nallowed_origins = ["*"]\nlog_format = "json"\n'
        'max_num_seqs = 4\nprefill_chunk = 128\n')
    config = serve_config("--config", str(tmp_path / "inference.toml"), "--port", "8200", "--api-key", "from-flag",
                          "--local")
    assert config.model.bundle == tmp_path / "bundles" / "qwen"  # relative to the file
    assert config.model.storaged is None  # --local wins over the file
    assert (config.port, config.max_tokens, config.max_queue, config.request_timeout) == (8200, 512, 0, 600)
    assert (config.max_num_seqs, config.prefill_chunk) == (4, 128)
    assert serve_config("--config", str(tmp_path / "inference.toml"), "--max-num-seqs", "2").max_num_seqs == 2
    assert config.api_keys == ("from-flag", "from-file") and config.allowed_origins == ("*",)
    assert config.log_format == "json" and config.served_model_name == "qwen"
    assert "from-flag" not in repr(config)  # keys stay out of logs
    monkeypatch.setenv("INFERENCE_API_KEY", "from-env")
    assert serve_config("--bundle", "b").api_keys == ("from-env",)


@pytest.mark.parametrize("argv, file, message", [
    (["--bundle", "b", "--max-queue", "-1"], None, "'max_queue' = -1"),
    (["--bundle", "b", "--request-timeout", "-5"], None, "'request_timeout' = -5"),
    (["--bundle", "b", "--max-num-seqs", "0"], None, "'max_num_seqs' = 0"),
    (["--bundle", "b", "--max-num-seqs", "1000"], None, "'max_num_seqs' = 1000"),
    (["--bundle", "b", "--prefill-chunk", "-1"], None, "'prefill_chunk' = -1"),
    ([], "bundle = 'b'\nmax_num_seqs = 2.5\n", "'max_num_seqs' = 2.5"),
    (["--bundle", "b", "--max-model-len", "64", "--max-tokens", "64"], None, "'max_tokens' = 64"),
    (["--bundle", "b", "--api-key-file", "/nonexistent/keys"], None, "'api_key_file'"),
    ([], None, "'bundle' is required"),
    ([], "bundle = 'b'\nmax_tokens = 'lots'\n", "'max_tokens' = 'lots'"),
    ([], "bundle = 'b'\nmax_token = 5\n", "unknown key(s) max_token"),
    ([], "bundle = 'b'\nport = \n", "not valid TOML"),
    ([], "bundle = 'b'\nexperts_compute = 'fast'\n", "'experts_compute' = 'fast'"),
    ([], "bundle = 'b'\nlookahead = -2\n", "'lookahead' = -2"),
    (["--bundle", "b", "--storaged", "/s", "--lookahead-min-precision", "1.5"], None,
     "'lookahead_min_precision' = 1.5"),
    (["--bundle", "b", "--storaged", "/s", "--lookahead", "0", "--lookahead-min-precision", "0.5"], None,
     "'lookahead_min_precision' = 0.5: given with lookahead off"),
    (["--bundle", "b", "--lookahead-min-precision", "0.5"], None,  # auto is off without storaged
     "'lookahead_min_precision' = 0.5: given with lookahead off"),
    ([], "bundle = 'b'\nstoraged = '/s'\nlookahead_min_precision = 'high'\n", "'lookahead_min_precision' = 'high'"),
    ([], "bundle = 'b'\nstoraged = '/s'\nlookahead_min_precision = nan\n", "'lookahead_min_precision' = nan"),
    ([], "bundle = 'b'\nstatic_cache_len = 'long'\n", "'static_cache_len' = 'long'"),
    (["--bundle", "b", "--cpu-experts-threads", "4"], None,
     "'cpu_experts_threads' = 4: CPU experts compute storaged's host-tier experts: no storaged socket given"),
    (["--bundle", "b", "--storaged", "/s", "--cpu-experts-threads", "4", "--static-cache-len", "0"], None,
     "'cpu_experts_threads' = 4: CPU experts run inside the static decoder's steps"),
    (["--bundle", "b", "--storaged", "/s", "--cpu-experts-share", "0.5"], None,
     "'cpu_experts_share' = 0.5: given with cpu_experts_threads 0"),
    (["--bundle", "b", "--storaged", "/s", "--cpu-experts-threads", "4", "--cpu-experts-share", "0"], None,
     "'cpu_experts_share' = 0.0"),
    ([], "bundle = 'b'\nstoraged = '/s'\ncpu_experts_threads = 2.5\n", "'cpu_experts_threads' = 2.5"),
    (["--bundle", "b", "--storaged", "/s", "--cpu-experts-copy-engine"], None,
     "'cpu_experts_copy_engine' = True: the copy agent runs beside the CPU experts: cpu_experts_threads is 0"),
    ([], "bundle = 'b'\nstoraged = '/s'\ncpu_experts_threads = 2\ncpu_experts_copy_engine = 'yes'\n",
     "'cpu_experts_copy_engine' = 'yes'"),
])
def test_bad_serve_configuration_exits_2_naming_the_field(tmp_path, capsys, argv, file, message):
    if file is not None:
        (tmp_path / "inference.toml").write_text(file)
        argv = [*argv, "--config", str(tmp_path / "inference.toml")]
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and message in err, err


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == "inference 0.1.0"


# --- generate's configuration: one frozen GenerateConfig, built from the flags --------------

def test_generate_flags_become_one_generate_config(tmp_path):
    args = build_parser().parse_args(["generate", "--bundle", str(tmp_path), "--prompt", "hi", "--chat",
                                      "--max-tokens", "7", "--temperature", "0.5", "--seed", "3", "--stop", "x",
                                      "--dtype", "float32", "--lookahead", "0"])
    config = generate_config_from_args(args)
    assert (config.prompt, config.chat) == ("hi", True)
    assert config.sampling == SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("x",))
    assert config.model == ModelConfig(bundle=tmp_path, dtype="float32", lookahead=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.prompt = "other"  # type: ignore[misc]


@pytest.mark.parametrize("argv, expected", [
    ([], 0.87),
    (["--lookahead", "4", "--lookahead-min-precision", "0.25"], 0.25),
    (["--lookahead", "4", "--lookahead-min-precision", "0"], 0.0),
])
def test_generate_lookahead_min_precision_flag(tmp_path, argv, expected):
    args = build_parser().parse_args(["generate", "--bundle", str(tmp_path), "--prompt", "hi", *argv])
    assert generate_config_from_args(args).model.min_precision() == expected


def test_serve_reads_lookahead_min_precision_from_the_file_and_the_flag(tmp_path):
    (tmp_path / "inference.toml").write_text("bundle = 'b'\nstoraged = '/s'\nlookahead_min_precision = 0\n")
    from_file = ["serve", "--config", str(tmp_path / "inference.toml")]
    assert serve_config_from_args(build_parser().parse_args(from_file)).model.min_precision() == 0.0
    flag = [*from_file, "--lookahead-min-precision", "0.75"]
    assert serve_config_from_args(build_parser().parse_args(flag)).model.lookahead_min_precision == 0.75


def test_cpu_experts_flags_and_file_become_one_config(tmp_path):
    (tmp_path / "inference.toml").write_text("bundle = 'b'\nstoraged = '/s'\ncpu_experts_threads = 12\n")
    from_file = ["serve", "--config", str(tmp_path / "inference.toml")]
    model = serve_config_from_args(build_parser().parse_args(from_file)).model
    assert model.cpu_experts() == CpuExpertsConfig(12)  # the share tuned while decoding
    flag = [*from_file, "--cpu-experts-share", "0.5"]
    assert serve_config_from_args(build_parser().parse_args(flag)).model.cpu_experts() == CpuExpertsConfig(12, 0.5)
    flag = [*from_file, "--cpu-experts-copy-engine"]
    assert serve_config_from_args(build_parser().parse_args(flag)).model.cpu_experts() == CpuExpertsConfig(
        12, None, copy_engine=True)
    args = build_parser().parse_args(["generate", "--bundle", str(tmp_path), "--prompt", "hi"])
    assert generate_config_from_args(args).model.cpu_experts() is None  # off by default


def test_generate_refuses_min_precision_with_lookahead_off(qwen_bundle, capsys):
    assert main(generate_args(qwen_bundle, "--lookahead", "0", "--lookahead-min-precision", "0.3")) == 2
    assert "'lookahead_min_precision' = 0.3: given with lookahead off" in capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    ({"model": "bundle-dir"}, "'model' = 'bundle-dir'"),
    ({"prompt": None}, "'prompt' = None"),
    ({"chat": "yes"}, "'chat' = 'yes'"),
    ({"sampling": {"max_tokens": 4}}, "'sampling'"),
])
def test_generate_config_refuses_wrong_values_naming_the_field(tmp_path, fields, message):
    values = {"model": ModelConfig(bundle=tmp_path), "prompt": "p", "sampling": SamplingParams(max_tokens=4),
              **fields}
    with pytest.raises(ConfigError, match=re.escape(message)):
        GenerateConfig(**values)


@pytest.mark.parametrize("module", ["inference/config.py", "inference/server/run.py", "inference/engine"])
def test_only_the_cli_sees_argparse(module):
    """Configuration travels as the frozen dataclasses; the parsed command line stays in inference.cli."""
    path = REPO / module
    for source in [path] if path.is_file() else sorted(path.rglob("*.py")):
        imported = {alias.name for node in ast.walk(ast.parse(source.read_text()))
                    if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
        assert "argparse" not in imported, source
