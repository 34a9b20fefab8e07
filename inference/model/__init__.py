"""A pack bundle loaded into transformers, routed experts served by an expert source."""

from inference.model.dense import build_meta_model, initialize_non_persistent_buffers, load_dense
from inference.model.errors import DenseWeightsError, ModelLoadError, TokenizerLoadError, UninitializedBufferError
from inference.model.loader import ExpertSourceFactory, LoadedModel, load_model

__all__ = [
    "load_model", "LoadedModel", "ExpertSourceFactory", "build_meta_model", "load_dense",
    "initialize_non_persistent_buffers", "ModelLoadError", "DenseWeightsError", "TokenizerLoadError",
    "UninitializedBufferError",
]
