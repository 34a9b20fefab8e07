"""Requests whose bytes are not the message their method takes: INVALID_ARGUMENT, not a traceback.

grpc.aio parses a request with the method's deserializer before any servicer code runs; when the
parser raises, grpc logs the exception with its traceback and answers UNKNOWN. This interceptor,
installed on the whole server (ExpertStorage, health, reflection), swaps every method's
deserializer for one that never raises: bytes that do not parse become a `Malformed` value, and
the method's behaviour is wrapped so that such a value ends the call with INVALID_ARGUMENT
before the servicer sees it. On a request stream (Acquire) the call ends at the malformed
message, as a client ending its stream does: a session bound to that stream is closed, as the
data plane closes the connection after a malformed frame.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable

import grpc

MESSAGE_LIMIT = 200  # characters of the parser's own explanation kept in the status message


class Malformed:
    """What the lenient deserializer returns for bytes its message type cannot parse."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _lenient(deserializer: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or what another parser raises
            reason = str(exc)[:MESSAGE_LIMIT] or type(exc).__name__
            return Malformed(f"{method}: the request ({len(data)} bytes) is not a valid message: {reason}")
    return deserialize


def _unary_request(behaviour: Callable) -> Callable | None:
    """The behaviour of a method taking one request, refusing a Malformed one first."""
    if inspect.isasyncgenfunction(behaviour):
        async def generate(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behaviour(request, context):
                yield response
        return generate
    if inspect.iscoroutinefunction(behaviour):
        async def call(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behaviour(request, context)
        return call
    return None  # a synchronous handler: left as it is (this server registers none)


async def _checked(requests: AsyncIterator, context) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _stream_request(behaviour: Callable) -> Callable | None:
    """The behaviour of a method taking a request stream, whose iterator refuses a Malformed message."""
    if inspect.isasyncgenfunction(behaviour):
        async def generate(requests, context):
            async for response in behaviour(_checked(requests, context), context):
                yield response
        return generate
    if inspect.iscoroutinefunction(behaviour):
        async def call(requests, context):
            return await behaviour(_checked(requests, context), context)
        return call
    return None


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler  # raw bytes reach the servicer: nothing to parse here
    if handler.request_streaming:
        behaviour = handler.stream_stream if handler.response_streaming else handler.stream_unary
        wrapped = _stream_request(behaviour)
    else:
        behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary
        wrapped = _unary_request(behaviour)
    if wrapped is None:
        return handler
    deserializer = _lenient(handler.request_deserializer, method)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        wrapped, request_deserializer=deserializer, response_serializer=handler.response_serializer)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a request that does not parse, for every method of the server."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:  # built once per method: calls stay cheap
            cached = self._guarded[method] = (handler, _guarded(handler, method))
        return cached[1]
