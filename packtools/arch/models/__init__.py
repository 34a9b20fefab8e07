"""One module per supported MoE architecture, named after its transformers `model_type`.

Each module exports `ARCHITECTURE`, a packtools.arch.record.Architecture: the Hugging Face names
(ArchSpec), the tiny test config, the routing check and the GGUF mapping (GGUFArch).
packtools.arch.registry imports every module here whose name does not start with "_", so adding
an architecture is one new module (plus its golden data for the llama.cpp comparison); modules
whose name starts with "_" hold parts several architectures share.
"""
