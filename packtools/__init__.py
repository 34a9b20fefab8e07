"""packtools: convert GGUF and Hugging Face MoE checkpoints into expert pack bundles."""

__version__ = "0.1.0"
