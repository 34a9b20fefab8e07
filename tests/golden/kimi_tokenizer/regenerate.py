"""Regenerate tests/golden/kimi_tokenizer: llama.cpp's own tokenization of the synthetic Kimi vocabulary.

Writes, from the rank table tests/packtools/kimi_tiktoken_synth.py trains:
  kimi_k2_vocab.gguf   a vocabulary-only GGUF laid out as llama.cpp's converter writes Kimi's
                       (conversion/kimi_linear.py set_vocab: tokenizer.ggml.model = gpt2,
                       pre = kimi-k2, tokens spelled byte-level in rank order, every special token
                       CONTROL, one merge per token from the converter's own QwenModel.bpe)
  llamacpp_ids.json    the ids llama.cpp (libllama through the llama_cpp bindings, vocab_only)
                       gives every text of encode_cases(), special tokens parsed, no BOS

Needs what scripts/llamacpp_golden.py sets up (fetch, build, deps). Usage:
  /work/venv/bin/python tests/golden/kimi_tokenizer/regenerate.py [--work /var/tmp/llamacpp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent
REPO = GOLDEN.parents[2]
GGUF_NAME = "kimi_k2_vocab.gguf"
IDS_NAME = "llamacpp_ids.json"


def _inner() -> None:
    """Runs with the vendored gguf-py, converter and llama_cpp bindings on sys.path."""
    import gguf  # the vendored gguf-py
    from conversion.qwen import QwenModel  # llama.cpp's converter: the merges it derives from tiktoken ranks
    from llama_cpp import Llama, __version__
    from llamacpp_golden import _llama_cpp_commit

    import kimi_tiktoken_synth as synth

    ranks = synth.train_ranks()
    specials = synth.special_ids(len(ranks))
    spell = QwenModel.token_bytes_to_string
    merges = []
    for token, rank in ranks.items():
        if len(token) > 1:
            parts = QwenModel.bpe(ranks, token, max_rank=rank)
            if len(parts) == 2:
                merges.append(" ".join(map(spell, parts)))
    by_id = {rank: spell(token) for token, rank in ranks.items()} | {i: name for name, i in specials.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [gguf.TokenType.CONTROL if i in specials.values() else gguf.TokenType.NORMAL for i in range(len(tokens))]

    path = GOLDEN / GGUF_NAME
    writer = gguf.GGUFWriter(str(path), "llama")  # vocab_only loading still reads one arch's hyperparameters
    writer.add_context_length(256)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("kimi-k2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials["[BOS]"])
    writer.add_eos_token_id(specials["[EOS]"])
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    llm = Llama(str(path), vocab_only=True, verbose=False)
    cases = [{"text": text, "ids": llm.tokenize(text.encode(), add_bos=False, special=True)}
             for text in synth.encode_cases(len(ranks))]
    record = {"vocab_sha256": synth.ranks_sha256(ranks), "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
              "llama_cpp_python": __version__, "llama_cpp_commit": _llama_cpp_commit(), "cases": cases}
    (GOLDEN / IDS_NAME).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(tokens)} tokens, {len(merges)} merges) and {len(cases)} cases")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/llamacpp"))
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests" / "packtools")]
    if args.inner:
        return _inner()
    from llamacpp_golden import Paths, _vendored_env

    env = _vendored_env(Paths(args.work))
    env["PYTHONPATH"] += ":" + ":".join(sys.path[:2])
    subprocess.run([sys.executable, __file__, "--inner"], env=env, check=True)


if __name__ == "__main__":
    main()
