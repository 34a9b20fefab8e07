"""`inference serve`: bind first, load the model in the background, stop cleanly on SIGTERM/SIGINT.

/health answers 503 while the model loads, so a supervisor can tell "starting" from "down".
A model that fails to load ends the process with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import threading

from aiohttp import web

from inference.config import default_model_name, load_from_args
from inference.engine import Engine, EngineMetrics
from inference.server.app import ServerState, create_app

log = logging.getLogger(__name__)
EXIT_FORCED = 130  # the shell's status for a process ended by SIGINT


def _load_in_background(args: argparse.Namespace, metrics: EngineMetrics) -> concurrent.futures.Future:
    # a daemon thread, not an executor: a SIGTERM during a long load must not wait for it to finish
    future: concurrent.futures.Future = concurrent.futures.Future()

    def load() -> None:
        try:
            future.set_result(Engine.from_loaded(load_from_args(args), metrics=metrics,
                                                 static_cache_len=args.static_cache_len))
        except BaseException as exc:  # reported by the serving loop
            future.set_exception(exc)

    threading.Thread(target=load, name="inference-load", daemon=True).start()
    return future


async def serve_async(args: argparse.Namespace) -> int:
    metrics = EngineMetrics()
    state = ServerState(model_name=args.model_name or default_model_name(args.bundle), metrics=metrics)
    runner = web.AppRunner(create_app(state), handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=args.shutdown_timeout, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"inference: serving {state.model_name!r} on http://{host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():  # a second signal: the user does not want to wait for in-flight requests
            log.warning("%s again: exiting without waiting", signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("%s: finishing in-flight requests, then exiting", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loading = asyncio.wrap_future(_load_in_background(args, metrics))
    stopping = asyncio.create_task(stop.wait())
    exit_code = 0
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        try:
            state.engine = loading.result()
            log.info("model %r loaded; ready", state.model_name)
        except Exception as exc:
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.error("could not load %s: %s", args.bundle, state.load_error)
            exit_code = 1
            stop.set()
        await stopping
    else:
        loading.cancel()  # the load thread dies with the process
    log.info("shutting down")
    await runner.cleanup()  # stops accepting, lets in-flight requests finish (up to shutdown_timeout)
    if state.engine is not None:
        await asyncio.to_thread(state.engine.close)
    log.info("stopped")
    return exit_code


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_async(args))
