"""`inference generate` (stream a completion to the terminal) and `inference serve` (OpenAI-compatible HTTP)."""

from __future__ import annotations

import argparse
import sys

from inference.config import ExpertSourceNotAvailableError, add_model_arguments, load_from_args
from inference.engine import (
    Engine,
    EngineError,
    Finished,
    InvalidRequestError,
    SamplingParams,
    encode_chat,
    encode_completion_prompt,
)
from inference.model import ModelLoadError
from inference.server.run import serve

EXIT_USAGE = 2  # argparse's status for a bad command line; also a request the model cannot take
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inference", description=__doc__)
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

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    serve.add_argument("--model-name", default=None, help="the model id clients use (default: bundle dir name)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="how long in-flight requests may run on after SIGTERM/SIGINT (default 30)")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, stop=tuple(args.stop))
    except EngineError as exc:
        print(f"inference generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    loaded = load_from_args(args)
    engine = Engine.from_loaded(loaded, static_cache_len=args.static_cache_len)
    try:
        tokenizer = engine.tokenizer
        if args.chat:
            prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": prompt}])
        else:
            prompt_ids = encode_completion_prompt(tokenizer, prompt)
        finished = None
        for event in engine.generate(prompt_ids, params):
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
            return run_generate(args)
        return serve(args)
    except (ExpertSourceNotAvailableError, InvalidRequestError) as exc:
        print(f"inference {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (EngineError, ModelLoadError, OSError) as exc:
        print(f"inference {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"inference {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
