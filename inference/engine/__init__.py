"""Text generation over a loaded model: a FIFO request queue, one worker thread, our own sampling."""

from inference.engine.engine import Engine, Health, Job
from inference.engine.errors import (
    EngineClosedError,
    EngineError,
    EngineInternalError,
    ExpertSourceUnavailableError,
    InvalidRequestError,
)
from inference.engine.generate import ModelRunner, context_length_of, eos_token_ids
from inference.engine.metrics import EngineMetrics
from inference.engine.params import Finished, GenerationEvent, SamplingParams, TextDelta, Usage
from inference.engine.prompt import encode_chat, encode_completion_prompt

__all__ = [
    "Engine", "Health", "Job", "ModelRunner", "EngineMetrics", "SamplingParams", "TextDelta", "Finished",
    "GenerationEvent", "Usage", "encode_chat", "encode_completion_prompt", "context_length_of",
    "eos_token_ids", "EngineError", "InvalidRequestError", "ExpertSourceUnavailableError", "EngineClosedError",
    "EngineInternalError",
]
