"""GGUF checkpoints: reading them as a packtools source, and the mapping to transformers.

- source.GGUFSource: a GGUF file or llama.cpp split set as a CheckpointSource.
- config_write / config_read: transformers config <-> GGUF metadata, per architecture (archs).
- tensor_map / expert_map: transformers state_dict keys <-> GGUF tensors (gguf-py's names).
- files, experts, dense, metadata, tokenizer: the reading side's parts.
- reference.load_reference_model: the fully resident transformers model a source describes.
- errors: the typed errors all of these raise.

Writing GGUFs (synthetic checkpoints) lives in packtools.synth.gguf_writer / gguf_stream.
"""
