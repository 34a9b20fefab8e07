"""Model options shared by `inference generate` and `inference serve`, and the expert source factory."""

from __future__ import annotations

import argparse
import os

import torch

from inference.engine.timed_source import TimedExpertSource
from inference.experts import COMPUTE_MODES, ExpertSource, LocalPackSource
from inference.model import LoadedModel, load_model
from packtools.bundle import Bundle

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEVICES = ("cpu", "cuda")


class ExpertSourceNotAvailableError(Exception):
    """The expert source chosen on the command line cannot be used: the storaged daemon is not
    reachable, does not serve the model, or serves another bundle under its name."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--bundle, --device, --dtype, --torch-threads and the expert source choice (--local | --storaged
    [--storaged-model NAME])."""
    parser.add_argument("--bundle", required=True, help="pack bundle directory (made by `packtools build`)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the model runs (default cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
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
    parser.add_argument("--experts-compute", choices=COMPUTE_MODES, default="auto",
                        help="auto (default): fused kernels reading quantized slots in place on CUDA, the exact "
                             "path elsewhere; exact: eager's per-expert arithmetic everywhere; fused: refuse to "
                             "start where the fused kernels cannot run")
    parser.add_argument("--lookahead", type=_lookahead, default="auto", metavar="N|auto",
                        help="experts per token each MoE layer predicts for the next one and hints to storaged "
                             "(0: off; auto: twice the model's top-k with --storaged, off otherwise)")
    parser.add_argument("--static-cache-len", type=_non_negative, default=4096, metavar="TOKENS",
                        help="decode through a static KV cache of this many tokens, each step one CUDA graph "
                             "reading experts via storaged's slot map, where the model allows it (default 4096; "
                             "0: off); longer requests decode eagerly")


def _lookahead(text: str) -> int | str:
    return "auto" if text == "auto" else _non_negative(text)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def lookahead_of(args: argparse.Namespace, config) -> int:
    """Experts per token to hint for the next layer: the flag, or for "auto" 2 x top-k with storaged."""
    value = getattr(args, "lookahead", 0)
    if value != "auto":
        return value
    if not getattr(args, "storaged", None):
        return 0
    from packtools.arch import get_arch

    return 2 * get_arch(config.model_type).top_k(config)


def make_expert_source(args: argparse.Namespace, bundle: Bundle, device: torch.device | str | None = None
                       ) -> ExpertSource:
    """The expert source the command line asks for, for the opened bundle, on `device`."""
    device = torch.device(device if device is not None else args.device)
    if getattr(args, "storaged", None):
        return _storaged_source(args.storaged, getattr(args, "storaged_model", None) or default_model_name(bundle.path),
                                bundle, device)
    # the wrapper reports the time spent in acquire (expert_wait_seconds) for the metrics
    return TimedExpertSource(LocalPackSource(bundle, device))


def _storaged_source(socket_path: str, model_name: str, bundle: Bundle, device: torch.device) -> ExpertSource:
    # imported here: grpc and the storaged client are only needed with --storaged
    from inference.experts.errors import ExpertsError
    from inference.experts.storaged_source import StoragedExpertSource
    from storaged.client import StorageError

    try:  # no waiting for the daemon: start it first (its systemd unit notifies READY once serving)
        return StoragedExpertSource(socket_path, model_name, bundle, device)
    except (StorageError, ExpertsError) as exc:
        raise ExpertSourceNotAvailableError(f"--storaged {socket_path} (model {model_name!r}): the storaged expert "
                                            f"source is not available: {exc}") from exc


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    """Load the bundle as the parsed model arguments say."""
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.bundle)
    return load_model(args.bundle, device=args.device, dtype=DTYPES[args.dtype],
                      expert_source=lambda bundle, device: make_expert_source(args, bundle, device),
                      experts_compute=getattr(args, "experts_compute", "auto"),
                      lookahead=lookahead_of(args, config))


def default_model_name(bundle_dir: str | os.PathLike) -> str:
    return os.path.basename(os.path.normpath(os.fspath(bundle_dir)))
