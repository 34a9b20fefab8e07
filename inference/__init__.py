"""inference: the transformers client that runs MoE models with experts served by storaged."""
