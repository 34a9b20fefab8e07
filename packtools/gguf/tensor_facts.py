"""TensorFacts: what a GGUF's tensor list says about the model that its metadata may not.

gguf.source reads them off the file; config_read and the modules of the archs gguf-py lacks
(deepseek4, kimi_k3) turn them into config kwargs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    """What the tensor list says that the metadata may not."""

    vocab_size: int  # rows of token_embd.weight
    tied_embeddings: bool  # no output.weight: the LM head reuses token_embd
    attention_bias: bool  # blk.0.attn_q.bias exists
    shared_expert_rows: int | None  # rows of blk.N.ffn_gate_shexp.weight, if any
    names: frozenset[str] = frozenset()  # every tensor name, for optional tensors that set a switch
