"""Text generation over a loaded model: a FIFO request queue, one worker thread, our own sampling."""

from inference.engine.engine import Engine, Health, Liveness
from inference.engine.errors import (
    EngineClosedError,
    EngineError,
    EngineInternalError,
    ExpertCapacityExhaustedError,
    ExpertDataLossError,
    ExpertSourceUnavailableError,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
)
from inference.engine.generate import ModelRunner, context_length_of, eos_token_ids
from inference.engine.job import Choice, Job
from inference.engine.metrics import EngineMetrics
from inference.engine.params import Finished, GenerationEvent, SamplingParams, TextDelta, TokenLogprob, Usage
from inference.engine.prompt import encode_chat, encode_completion_prompt

__all__ = [
    "Engine", "Health", "Liveness", "Job", "Choice", "ModelRunner", "EngineMetrics", "SamplingParams",
    "TextDelta", "Finished", "GenerationEvent", "Usage", "TokenLogprob", "encode_chat",
    "encode_completion_prompt", "context_length_of", "eos_token_ids", "EngineError", "InvalidRequestError",
    "ExpertSourceUnavailableError", "ExpertDataLossError", "ExpertCapacityExhaustedError", "EngineClosedError",
    "EngineInternalError", "QueueFullError", "RequestTimeoutError",
]
