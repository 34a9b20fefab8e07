"""`inference generate` (stream a completion to the terminal) and `inference serve` (OpenAI-compatible HTTP)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from inference import __version__
from inference.config import (
    DEVICES,
    DTYPES,
    GENERATION_CONFIG_CHOICES,
    LOG_FORMATS,
    LOG_LEVELS,
    MODEL_FIELDS,
    SERVE_FIELDS,
    ConfigError,
    ExpertSourceNotAvailableError,
    GenerateConfig,
    ModelConfig,
    ServeConfig,
    load_from_config,
    load_serve_config,
)
from inference.engine import (
    Engine,
    EngineError,
    Finished,
    InvalidRequestError,
    SamplingParams,
    encode_chat,
    encode_completion_prompt,
)
from inference.experts import COMPUTE_MODES, ExpertsError
from inference.model import ModelLoadError
from inference.server.run import serve

EXIT_USAGE = 2  # argparse's status for a bad command line; also a request the model cannot take
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """--bundle, --device, --dtype, --torch-threads and the expert source choice (--local | --storaged
    [--storaged-model NAME]). defaults=False leaves unset options None (a config file may set them)."""
    parser.add_argument("--bundle", required=defaults, help="pack bundle directory (made by `packtools build`)")
    parser.add_argument("--device", choices=DEVICES, default="cpu" if defaults else None,
                        help="where the model runs (default cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if defaults else None,
                        help="dtype of the dense weights and activations (default bfloat16)")
    parser.add_argument("--torch-threads", type=int, default=None, metavar="N",
                        help="torch intra-op threads on CPU (default: torch's choice)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--local", action="store_true",
                        help="read experts straight from the bundle's pack (the default)")
    source.add_argument("--storaged", metavar="SOCKET", default=None,
                        help="get experts from the storaged daemon listening on this Unix socket")
    parser.add_argument("--storaged-model", metavar="NAME", default=None,
                        help="with --storaged: the daemon's name for this bundle (its `--model NAME=DIR`); "
                             "default: the bundle directory's name")
    parser.add_argument("--experts-compute", choices=COMPUTE_MODES, default="auto" if defaults else None,
                        help="auto (default): fused kernels reading quantized slots in place on CUDA, the exact "
                             "path elsewhere; exact: eager's per-expert arithmetic everywhere; fused: refuse to "
                             "start where the fused kernels cannot run")
    parser.add_argument("--lookahead", type=_lookahead, default="auto" if defaults else None, metavar="N|auto",
                        help="experts per token each MoE layer predicts for the next one and hints to storaged "
                             "(0: off; auto, the default: the model's top-k with --storaged, off otherwise)")
    parser.add_argument("--lookahead-min-precision", type=_fraction, default=None, metavar="F",
                        help="send a step width's lookahead hints only while at least this share of the hinted "
                             "experts is used by the next layer (default 0.87: at most ~15%% of the bytes wasted; "
                             "0: always send); needs lookahead on")
    parser.add_argument("--static-cache-len", type=_non_negative, default=4096 if defaults else None,
                        metavar="TOKENS",
                        help="decode through a static KV cache of this many tokens, each step one CUDA graph "
                             "reading experts via storaged's slot map, where the model allows it (default 4096; "
                             "0: off); longer requests decode eagerly")
    parser.add_argument("--cpu-experts-threads", type=_non_negative, default=0 if defaults else None, metavar="N",
                        help="CPU threads that compute a share of each decode step's host-tier experts beside the "
                             "GPU (needs --storaged with a host tier, CUDA and the static cache; 0: off, the "
                             "default); they spin while steps run")
    parser.add_argument("--cpu-experts-share", type=_fraction, default=None, metavar="F",
                        help="the share of each layer's host-tier experts the CPU threads compute, fixed (default: "
                             "tuned while decoding, from 0.35, to the share whose steps are fastest)")
    parser.add_argument("--cpu-experts-copy-engine", action="store_true", default=False if defaults else None,
                        help="with --cpu-experts-threads: copy the GPU's share of the host-tier experts to VRAM with "
                             "the copy engine (a host thread aims it at each layer's experts) instead of reading "
                             "them in place over the link")


def _lookahead(text: str) -> int | str:
    return "auto" if text == "auto" else _non_negative(text)


def _fraction(text: str) -> float:  # the range is ModelConfig's to check
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of `add_model_arguments`' flags (with their defaults)."""
    return ModelConfig(**{name: getattr(args, name) for name in MODEL_FIELDS})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inference", description=__doc__)
    parser.add_argument("--version", action="version", version=f"inference {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a completion and stream it to stdout")
    add_model_arguments(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text ('-' reads it from stdin)")
    generate.add_argument("--chat", action="store_true",
                          help="send the prompt as a user message through the tokenizer's chat template")
    generate.add_argument("--max-tokens", type=_positive_int, default=128, help="default 128")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop before this text (repeatable)")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                description="Flags override the --config file's keys (the same names, "
                                            "with _ for -); see docs/inference.md.")
    serve.add_argument("--config", type=Path, default=None, help="TOML file of serve options (flat keys)")
    add_model_arguments(serve, defaults=False)
    serve.add_argument("--host", default=None, help="default 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default 8000; 0 picks a free port (printed at start)")
    serve.add_argument("--model-name", default=None, help="the model id clients use (default: bundle dir name)")
    serve.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                       help="how long in-flight requests may run on after SIGTERM/SIGINT (default 30)")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
                        help="the context the server allows, prompt and completion together (default: the model's)")
    limits.add_argument("--max-tokens", type=_positive_int, default=None, metavar="TOKENS",
                        help="most tokens one choice may generate: larger requests get 400, requests without "
                             "max_tokens get this (default: no cap but the context)")
    limits.add_argument("--max-num-seqs", type=int, default=None, metavar="SEQUENCES",
                        help="choices generated together in the running batch (continuous batching); more "
                             "requests wait in the queue (default 16)")
    limits.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                        help="most prompt tokens of one sequence per batch step, so that a long prompt joining "
                             "the batch holds the running decodes for one chunk at a time (default 512)")
    limits.add_argument("--max-queue", type=int, default=None, metavar="REQUESTS",
                        help="requests that may wait while the batch is full; more get 429 with Retry-After "
                             "(default 256; 0: no limit)")
    limits.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="a request running longer than this from its arrival, queue wait included, is "
                             "stopped with 408 (default 0: no limit)")
    limits.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                        help="/health answers 503 while the generation worker is busy but has made no progress "
                             "for this long: a hung worker (default 60; 0: never)")
    serve.add_argument("--generation-config", choices=GENERATION_CONFIG_CHOICES, default=None,
                       help="auto (default): requests that omit temperature, top_p, top_k, min_p, "
                            "repetition_penalty or max_tokens get the bundle's generation_config.json values; "
                            "none: OpenAI's defaults")
    ops = serve.add_argument_group("operations")
    ops.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' (repeatable; also --api-key-file, and "
                          "$INFERENCE_API_KEY); /health, /metrics and /version stay open")
    ops.add_argument("--api-key-file", default=None, metavar="PATH", help="API keys, one per line")
    ops.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                     help="CORS: origins browsers may call from (repeatable or comma-separated; '*' for any)")
    ops.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="default info")
    ops.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                     help="text (default) or json: one JSON object per line, access log included")
    ops.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                     help="one log line per HTTP request (default on)")
    return parser


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig the --config file and the flags give (flags win; a flag not given is None)."""
    overrides = {name: getattr(args, name) for name in MODEL_FIELDS | SERVE_FIELDS if hasattr(args, name)}
    if args.allowed_origins is not None:  # repeatable, and comma-separated
        overrides["allowed_origins"] = tuple(o.strip() for item in args.allowed_origins for o in item.split(",")
                                             if o.strip())
    overrides["api_keys"] = tuple(args.api_key) if args.api_key else None
    overrides["api_key_file"] = args.api_key_file
    config = load_serve_config(args.config, overrides)
    if args.local and config.model.storaged is not None:  # --local overrides a file's storaged
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, storaged=None))
    return config


def generate_config_from_args(args: argparse.Namespace) -> GenerateConfig:
    """The GenerateConfig the flags give; a bad sampling value is InvalidRequestError naming it."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, stop=tuple(args.stop))
    return GenerateConfig(model_config_from_args(args), prompt, sampling, chat=args.chat)


def run_generate(config: GenerateConfig) -> int:
    loaded = load_from_config(config.model)
    engine = Engine.from_loaded(loaded, static_cache_len=config.model.static_cache_len,
                                cpu_experts=config.model.cpu_experts())
    try:
        tokenizer = engine.tokenizer
        if config.chat:
            prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": config.prompt}])
        else:
            prompt_ids = encode_completion_prompt(tokenizer, config.prompt)
        finished = None
        for event in engine.generate(prompt_ids, config.sampling):
            if isinstance(event, Finished):
                finished = event
            else:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        rate = finished.usage.completion_tokens / finished.generation_seconds if finished.generation_seconds else 0
        print(f"[finish_reason={finished.finish_reason} prompt_tokens={finished.usage.prompt_tokens} "
              f"completion_tokens={finished.usage.completion_tokens} ttft={finished.time_to_first_token:.3f}s "
              f"tokens_per_second={rate:.1f}]", file=sys.stderr)
        return 0
    finally:
        engine.close()
        loaded.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(generate_config_from_args(args))
        return serve(serve_config_from_args(args))
    except ConfigError as exc:
        print(f"inference {args.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ExpertSourceNotAvailableError, InvalidRequestError) as exc:
        print(f"inference {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (EngineError, ModelLoadError, ExpertsError, OSError) as exc:
        print(f"inference {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"inference {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
