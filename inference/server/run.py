"""`inference serve`: bind first, load the model in the background, stop cleanly on SIGTERM/SIGINT.

/health answers 503 while the model loads, so a supervisor can tell "starting" from "down".
A model that fails to load ends the process with status 1. Under systemd (Type=notify) the
server sends READY=1 once the model is loaded, STATUS= lines, STOPPING=1 on SIGTERM, and
WATCHDOG=1 pings only while the engine's worker makes progress (inference.server.watchdog).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading

from aiohttp import web

from inference import logs
from inference.config import ServeConfig, load_from_config
from inference.engine import Engine, EngineMetrics
from inference.engine.generation_defaults import GenerationConfigError, read_generation_defaults
from inference.server.app import create_app
from inference.server.middleware import PARSER_ERROR_LOG
from inference.server.state import ServerState
from inference.server.watchdog import EngineWatchdog
from servicekit.notify import Notifier, NotifyEnvironmentError

log = logging.getLogger("inference.server")
EXIT_FORCED = 130  # the shell's status for a process ended by SIGINT
STATUS_SECONDS = 10.0  # how often the STATUS= line is refreshed


def _load_in_background(config: ServeConfig, metrics: EngineMetrics) -> concurrent.futures.Future:
    # a daemon thread, not an executor: a SIGTERM during a long load must not wait for it to finish
    future: concurrent.futures.Future = concurrent.futures.Future()

    def load() -> None:
        try:
            engine = Engine.from_loaded(load_from_config(config.model), metrics=metrics,
                                        max_model_len=config.max_model_len, max_queue=config.max_queue or None,
                                        request_timeout=config.request_timeout or None,
                                        stall_timeout=config.stall_timeout or None,
                                        static_cache_len=config.model.static_cache_len,
                                        cpu_experts=config.model.cpu_experts(),
                                        max_num_seqs=config.max_num_seqs, prefill_chunk=config.prefill_chunk)
            future.set_result(engine)
        except BaseException as exc:  # reported by the serving loop
            future.set_exception(exc)

    threading.Thread(target=load, name="inference-load", daemon=True).start()
    return future


def _generation_defaults(config: ServeConfig) -> dict:
    if config.generation_config == "none":
        return {}
    defaults = read_generation_defaults(config.model.bundle)
    if defaults:
        log.info("sampling defaults from the bundle's generation_config.json (for requests that omit them): %s",
                 ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return defaults


async def _report_status(notifier: Notifier, state: ServerState, address: str) -> None:
    while True:
        engine = state.engine
        if engine is not None:
            notifier.status(f"serving {state.model_name} on {address}: {engine.running} running, "
                            f"{engine.waiting} waiting")
        await asyncio.sleep(STATUS_SECONDS)


async def serve_async(config: ServeConfig) -> int:
    try:
        notifier = Notifier.from_environment()
        defaults = _generation_defaults(config)
    except (NotifyEnvironmentError, GenerationConfigError) as exc:
        log.error("%s", exc)
        return 1
    metrics = EngineMetrics(model=config.served_model_name)
    state = ServerState(model_name=config.served_model_name, metrics=metrics, max_tokens=config.max_tokens,
                        generation_defaults=defaults, api_keys=config.api_keys,
                        allowed_origins=config.allowed_origins, access_log=config.access_log)
    runner = web.AppRunner(create_app(state), handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=config.shutdown_timeout, access_log=None, logger=PARSER_ERROR_LOG)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    address = f"http://{host}:{port}"
    print(f"inference: serving {state.model_name!r} on {address}", flush=True)
    if config.api_keys:
        log.info("API key required on every endpoint but /health, /metrics and /version (%d key(s))",
                 len(config.api_keys))
    notifier.status(f"loading {config.model.bundle}")

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
    loading = asyncio.wrap_future(_load_in_background(config, metrics))
    stopping = asyncio.create_task(stop.wait())
    background: list[asyncio.Task] = []
    exit_code = 0
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        try:
            state.engine = loading.result()
            log.info("model %r loaded; ready (context %s tokens)", state.model_name, state.engine.runner.context_length)
            notifier.ready(f"serving {state.model_name} on {address}")
            background += [asyncio.create_task(notifier.watchdog_forever(EngineWatchdog(state).alive)),
                           asyncio.create_task(_report_status(notifier, state, address))]
        except Exception as exc:
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.error("could not load %s: %s", config.model.bundle, state.load_error)
            exit_code = 1
            stop.set()
        await stopping
    else:
        loading.cancel()  # the load thread dies with the process
    log.info("shutting down")
    notifier.stopping(f"draining: in-flight requests get up to {config.shutdown_timeout:g} s")
    await runner.cleanup()  # stops accepting, lets in-flight requests finish (up to shutdown_timeout)
    for task in background:  # pings go on while draining: a long drain is not a hang
        task.cancel()
    if state.engine is not None:
        await asyncio.to_thread(state.engine.close)
    notifier.close()
    log.info("stopped")
    return exit_code


def serve(config: ServeConfig) -> int:
    logs.configure(config.log_level, config.log_format)
    return asyncio.run(serve_async(config))
