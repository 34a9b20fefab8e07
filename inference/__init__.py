"""inference: the transformers client that runs MoE models with experts served by storaged."""

__version__ = "0.1.0"
