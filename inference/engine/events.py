"""A job's sink turned into an iterator of its events: asynchronous (an asyncio queue fed from the
worker thread) or blocking. Leaving the iterator early cancels the job."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator

from inference.engine.generate import FINISH_CANCELLED
from inference.engine.job import Job, Sink
from inference.engine.params import Finished, GenerationEvent


def _last(event: Finished, ends: int, choices: int) -> bool:
    return ends == choices or event.finish_reason == FINISH_CANCELLED


async def async_events(submit: Callable[[Sink], Job], choices: int) -> AsyncIterator[GenerationEvent]:
    """TextDelta events and a Finished per choice; raises the EngineError the job ends with."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job: Job | None = None

    def sink(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            job.cancel()

    job = submit(sink)
    ends = 0
    try:
        while True:
            event = await events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Finished):
                ends += 1
                if _last(event, ends, choices):
                    return
    finally:
        job.cancel()  # no-op when finished


def blocking_events(submit: Callable[[Sink], Job], choices: int) -> Iterator[GenerationEvent]:
    """The blocking counterpart of async_events, for threads without an event loop."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    job = submit(events.put)
    ends = 0
    try:
        while True:
            event = events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Finished):
                ends += 1
                if _last(event, ends, choices):
                    return
    finally:
        job.cancel()
