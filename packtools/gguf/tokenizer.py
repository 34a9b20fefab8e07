"""Tokenizers and GGUF metadata, both ways.

Writing follows llama.cpp's `_set_vocab_gpt2` (byte-level BPE): the token list padded to the
model's vocab size with `[PAD<i>]`, token types (CONTROL for special added tokens), then gguf-py's
own SpecialVocab for merges, special token ids, add_bos/eos and the chat template.
Reading rebuilds a byte-level BPE vocabulary from the metadata itself (byte_level_tokenizer, the
same under every transformers version) and leaves other vocabularies (sentencepiece, unigram) to
transformers' GGUF tokenizer conversion, then `save_pretrained`.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import gguf
from transformers import PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from packtools.gguf.byte_level_tokenizer import (
    BYTE_LEVEL_MODEL,
    PRE_TOKENIZER_SPLITS,
    ByteLevelVocabError,
    byte_level_tokenizer,
)
from packtools.gguf.metadata import Metadata
from packtools.tokenizers_kimi import GGUF_PRE as KIMI_K2_PRE, apply_kimi_k2_pre_tokenizer

log = logging.getLogger(__name__)

GGUF_TOKENIZER_ORIGIN = "gguf-metadata"
GPT2_PRE = "gpt-2"  # llama.cpp's GPT-2 pre-tokenizer: the split transformers' byte-level builder uses by default


def _looks_special(token: str) -> bool:
    # llama.cpp's does_token_look_special, for added tokens not flagged special
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def _token_list(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> tuple[list[str], list[int]]:
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"tokenizer has ids up to {max(vocab.values())}, beyond vocab_size {vocab_size}")
    by_id = {index: token for token, index in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            special = added[index].special or _looks_special(token)
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write_vocab_kv(
    writer: gguf.GGUFWriter,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    pre: str = GPT2_PRE,
) -> None:
    """Add a byte-level BPE tokenizer's tokenizer.ggml.* keys (and chat template) to `writer`.

    Without a tokenizer only the special token ids are written, from the config, as the
    converter's SpecialVocab does when a checkpoint ships no tokenizer files.
    """
    with tempfile.TemporaryDirectory(prefix="packtools-vocab-") as staging:
        # gguf-py's SpecialVocab reads merges, special ids and the template from a checkpoint directory
        config.to_json_file(Path(staging) / "config.json")
        if tokenizer is not None:
            tokens, types = _token_list(tokenizer, config.vocab_size)
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(pre)
            writer.add_token_list(tokens)
            writer.add_token_types(types)
            tokenizer.save_pretrained(staging)
        special = gguf.SpecialVocab(staging, load_merges=tokenizer is not None, n_vocab=config.vocab_size)
        special.add_to_gguf(writer, quiet=True)


def rebuild_tokenizer(gguf_path: Path, meta: Metadata, out_dir: Path) -> dict:
    """Rebuild the tokenizer a GGUF describes into out_dir; the CheckpointSource.write_tokenizer dict."""
    model = meta.get(gguf.Keys.Tokenizer.MODEL)
    if model is None:
        return _none(f"{gguf_path.name} has no {gguf.Keys.Tokenizer.MODEL} key: the file carries no tokenizer")
    pre = meta.get(gguf.Keys.Tokenizer.PRE)
    try:
        if model == BYTE_LEVEL_MODEL:
            tokenizer = byte_level_tokenizer(meta)
            if pre == KIMI_K2_PRE:  # Moonshot's split regex, and tiktoken's whole pre-token lookup
                apply_kimi_k2_pre_tokenizer(tokenizer)
            note = f"rebuilt as a byte-level BPE from tokenizer.ggml.model={model!r}, pre={pre!r}"
        else:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            note = (f"rebuilt by transformers' GGUF tokenizer conversion from tokenizer.ggml.model={model!r}, "
                    f"pre={pre!r}")
    except ByteLevelVocabError as exc:
        return _none(str(exc))
    except (ValueError, KeyError, TypeError, NotImplementedError) as exc:
        return _none(f"transformers cannot build a tokenizer from tokenizer.ggml.model={model!r} (pre={pre!r}): {exc}")
    written = tokenizer.save_pretrained(str(out_dir))
    files = sorted({Path(p).name for p in written if Path(p).is_file()})
    if model == BYTE_LEVEL_MODEL and pre not in PRE_TOKENIZER_SPLITS and pre not in (GPT2_PRE, KIMI_K2_PRE):
        note += (f"; no split regex is known for pre={pre!r}, so text is pre-split the GPT-2 way, "
                 "which may tokenize differently from llama.cpp")
    return {"files": files, "origin": GGUF_TOKENIZER_ORIGIN, "note": note}


def _none(note: str) -> dict:
    log.warning("no tokenizer: %s", note)
    return {"files": [], "origin": "none", "note": note}
