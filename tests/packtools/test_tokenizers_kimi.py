"""packtools.tokenizers_kimi: Moonshot's TikToken tokenizer as a remote-code-free fast tokenizer.

Three independent references: tiktoken's algorithm written out in Python (kimi_tiktoken_synth,
with the `regex` module), llama.cpp's own tokenization (golden ids in tests/golden/kimi_tokenizer,
see its README), and, for the split regex alone, `regex` against the `tokenizers` library's
Oniguruma over every Unicode 14 code point. The vocabulary is trained in kimi_tiktoken_synth.
"""

from __future__ import annotations

import base64
import difflib
import json
import random
import unicodedata
from pathlib import Path

import gguf
import pytest
import regex
from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer

from inference.cli import main as inference_main
from packtools.build import build_bundle
from packtools.gguf.metadata import Metadata
from packtools.gguf.tokenizer import rebuild_tokenizer
from packtools.sources.hf import HFSource
from packtools.synth.hf import synth_hf
from packtools.tokenizers_kimi import (
    KIMI_PAT_STR,
    TiktokenConfigError,
    TiktokenFormatError,
    convert_tiktoken_checkpoint,
    fast_tokenizer_from_tiktoken,
    is_tiktoken_checkpoint,
    read_tiktoken_ranks,
)
from kimi_tiktoken_synth import (
    CORPUS,
    MOONSHOT_PAT_STR,
    SPLIT_WITNESSES,
    encode_cases,
    pre_tokens,
    ranks_sha256,
    reference_decode,
    reference_encode,
    special_ids,
    tiktoken_file_bytes,
    tokenizer_config,
    train_ranks,
    write_tiktoken_tokenizer,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "kimi_tokenizer"
# Where llama.cpp's kimi-k2 handler (src/unicode.cpp) departs from Moonshot's regex or from tiktoken:
# every differing stretch of ids must contain one of these, and each must show up somewhere.
LLAMACPP_DIVERGENCES = {
    "々": "its Han ranges omit U+3005, which is Script=Han: '時々' is split in two",
    "\u0301": "its word loop takes letters only, not the regex's \\p{M}: a combining accent ends the word",
    "Case": "it does not split at a lower-to-upper case change as the regex's two word alternatives do",
    " zyxwv": "it sets no ignore_merges for kimi-k2: a pre-token that is itself a token is still merged bytewise",
}


@pytest.fixture(scope="module")
def ranks():
    return train_ranks()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, ranks):
    directory = tmp_path_factory.mktemp("kimi-tokenizer")
    write_tiktoken_tokenizer(directory, ranks)
    return directory


@pytest.fixture(scope="module")
def tokenizer(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    assert convert_tiktoken_checkpoint(checkpoint, out) == ["tokenizer.json", "tokenizer_config.json"]
    return AutoTokenizer.from_pretrained(out)  # no trust_remote_code: the remote class must not be needed


def random_texts(count: int, seed: int = 7) -> list[str]:
    """Corpus words and single characters (corpus ones and troublesome extras) in random order."""
    rng = random.Random(seed)
    words = regex.findall(r"\S+|\s+", CORPUS)
    chars = sorted(set(CORPUS)) + list("々〇\u0301\u0308ſK\u00a0\u2028\u3000\r'’ÅåİıǅΣς٣")
    return ["".join(rng.choice(words) if rng.random() < 0.4 else rng.choice(chars) for _ in range(rng.randint(1, 30)))
            for _ in range(count)]


def test_the_split_regex_is_moonshots():
    assert KIMI_PAT_STR == MOONSHOT_PAT_STR


def test_ids_equal_tiktokens_algorithm_and_decode_round_trips(tokenizer, ranks):
    texts = encode_cases(len(ranks)) + random_texts(400)
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids == reference_encode(ranks, text), repr(text)
        assert tokenizer.decode(ids) == text == reference_decode(ranks, ids), repr(text)


def test_split_witnesses_are_single_tokens_only_where_the_regex_keeps_them_whole(tokenizer, ranks):
    # every witness is a token; the regex keeps "時々" and " café" (combining accent) whole
    single = [tokenizer(word).input_ids == [ranks[word.encode()]] for word in SPLIT_WITNESSES]
    assert single == [len(pre_tokens(word)) == 1 for word in SPLIT_WITNESSES] == [False, True, True, False]


def test_special_tokens_keep_moonshots_ids(tokenizer, ranks):
    base = len(ranks)
    expected = special_ids(base)
    assert len(tokenizer) == base + 256
    for content, token_id in expected.items():
        assert tokenizer.convert_tokens_to_ids(content) == token_id, content
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (base, base + 1)
    assert (tokenizer.unk_token_id, tokenizer.pad_token_id) == (base + 254, base + 255)
    assert tokenizer.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    ids = tokenizer("<think>x</think>[EOS]").input_ids  # no BOS is added, as TikTokenTokenizer.encode adds none
    assert ids[0] == expected["<think>"] and ids[-1] == expected["[EOS]"]
    # special: false in the config: matched whole, but kept when special tokens are skipped
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_ids_equal_llamacpp_except_its_known_divergences(tokenizer, ranks):
    golden = json.loads((GOLDEN / "llamacpp_ids.json").read_text())
    assert golden["vocab_sha256"] == ranks_sha256(ranks), "the synthetic vocabulary changed: run regenerate.py"
    assert [case["text"] for case in golden["cases"]] == encode_cases(len(ranks))
    seen = set()
    for case in golden["cases"]:
        ours = tokenizer(case["text"]).input_ids
        matcher = difflib.SequenceMatcher(a=ours, b=case["ids"], autojunk=False)
        for op, a0, a1, _, _ in matcher.get_opcodes():
            if op == "equal":
                continue
            stretch = tokenizer.decode(ours[a0:a1])
            causes = [cause for cause in LLAMACPP_DIVERGENCES if cause in stretch]
            assert causes, f"{case['text']!r}: llama.cpp differs on {stretch!r} for no known reason"
            seen.update(causes)
    assert seen == set(LLAMACPP_DIVERGENCES), f"divergences no longer seen: {set(LLAMACPP_DIVERGENCES) - seen}"


def test_gguf_rebuild_with_the_kimi_pre_tokenizer_equals_the_conversion(tokenizer, ranks, tmp_path):
    """llama.cpp's converter layout (one merge per token) + Kimi's split + ignore_merges = tiktoken:
    rebuild_tokenizer applies the Kimi pre-tokenizer itself for pre = kimi-k2."""
    path = GOLDEN / "kimi_k2_vocab.gguf"
    info = rebuild_tokenizer(path, Metadata(path, gguf.GGUFReader(path).fields), tmp_path)
    assert info["origin"] == "gguf-metadata", info
    rebuilt = AutoTokenizer.from_pretrained(tmp_path)
    rebuilt.save_pretrained(tmp_path / "saved")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    for text in encode_cases(len(ranks)) + random_texts(100, seed=8):
        expected = reference_encode(ranks, text)
        assert rebuilt(text, add_special_tokens=False).input_ids == expected, repr(text)
        assert reloaded(text, add_special_tokens=False).input_ids == expected, repr(text)


@pytest.mark.slow  # every Unicode 14 code point through both splitters: ~15 s
def test_oniguruma_splits_like_the_regex_module_on_every_unicode14_code_point():
    """`tokenizers` (Oniguruma) takes the `&&` intersections as written; the `regex` module (VERSION1,
    as tiktoken's Rust engine reads them) is the reference. Each code point is tried in contexts that
    probe every class of the pattern: case changes, Han runs, contractions, digits, whitespace."""
    split = pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated")
    pattern = regex.compile(KIMI_PAT_STR, regex.V1)
    assigned = [chr(c) for c in range(0x110000)
                if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) != "Cn"]
    assert unicodedata.unidata_version == "14.0.0"  # Python 3.11's tables say which code points are assigned
    for start in range(0, len(assigned), 2048):
        text = "".join(f"A{c}b 中{c}{c}'s\n{c}1 {c}  {c}|" for c in assigned[start:start + 2048])
        assert [piece for piece, _ in split.pre_tokenize_str(text)] == pattern.findall(text), hex(ord(assigned[start]))
    # Python's default (VERSION0) syntax has no class intersections; it reads the pattern differently
    assert regex.findall(KIMI_PAT_STR, "caféX") != pattern.findall("caféX")


@pytest.mark.parametrize("content, message", [
    (b"YQ== 0\nYg== 1\nYWI= 2 3\n", ":3: expected '<base64 token> <rank>'"),
    (b"YQ== 0\n!!!! 1\n", ":2: token b'!!!!' is not base64"),
    (b"YQ== 0\nYQ== 1\n", ":2: token b'a' repeats (first at rank 0)"),
    (b"YQ== 0\nYg== 2\n", "rank 1 is missing"),
    (b"YQ== 0\nYg== 0\n", "rank 1 is repeated"),
    (b"YQ== x\n", ":1: expected"),
    (b"\n\n", "no tokens"),
])
def test_malformed_tiktoken_files_are_refused_with_the_line(tmp_path, content, message):
    (tmp_path / "tiktoken.model").write_bytes(content)
    with pytest.raises(TiktokenFormatError, match=regex.escape(message)):
        read_tiktoken_ranks(tmp_path / "tiktoken.model")


BYTES = {bytes([b]): b for b in range(256)}


@pytest.mark.parametrize("change, message", [
    (lambda c: c["added_tokens_decoder"].update({"12": {"content": "<x>"}}), "has id 12, inside the 257"),
    (lambda c: c.update(bos_token="<nope>"), "bos_token '<nope>' is none of the special tokens"),
    (lambda c: c.update(additional_special_tokens=["<nope>"]), "additional special tokens ['<nope>']"),
    (lambda c: c["added_tokens_decoder"].update({"300": {"content": "ab"}}),
     "'ab' (id 300) is spelled like base token 256"),
    (lambda c: c["added_tokens_decoder"].update({"x1": {"content": "<x>"}}), "key 'x1' is not a token id"),
])
def test_inconsistent_configs_are_refused(tmp_path, change, message):
    (tmp_path / "tiktoken.model").write_bytes(tiktoken_file_bytes({**BYTES, b"ab": 256}))
    config = tokenizer_config(257)
    change(config)
    with pytest.raises(TiktokenConfigError, match=regex.escape(message)):
        fast_tokenizer_from_tiktoken(tmp_path / "tiktoken.model", config)


def test_reserved_range_grows_to_the_last_declared_id(tmp_path):
    (tmp_path / "tiktoken.model").write_bytes(tiktoken_file_bytes(BYTES))
    config = {"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[EOS]"},
                                       "513": {"content": "<|late|>"}}}  # Kimi-Linear declares 2 past 256
    converted = fast_tokenizer_from_tiktoken(tmp_path / "tiktoken.model", config)
    assert len(converted) == 514 and converted.convert_tokens_to_ids("<|late|>") == 513
    assert converted("a<|late|>b").input_ids == [ord("a"), 513, ord("b")]


@pytest.mark.parametrize("files, expected", [
    ({"tiktoken.model": "", "tokenizer_config.json": json.dumps({"tokenizer_class": "TikTokenTokenizer"})}, True),
    ({"tiktoken.model": "", "tokenizer_config.json": json.dumps({"tokenizer_class": "TikTokenTokenizer"}),
      "tokenizer.json": "{}"}, False),  # a fast tokenizer ships with it: nothing to convert
    ({"tiktoken.model": "", "tokenizer_config.json": json.dumps({"tokenizer_class": "LlamaTokenizer"})}, False),
    ({"tokenizer_config.json": json.dumps({"tokenizer_class": "TikTokenTokenizer"})}, False),
    ({"tiktoken.model": ""}, False),
    ({"tiktoken.model": "", "tokenizer_config.json": "{not json"}, False),
])
def test_tiktoken_checkpoints_are_recognised(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert is_tiktoken_checkpoint(tmp_path) is expected


def test_base64_of_every_byte_round_trips_through_the_file(tmp_path, ranks):
    (tmp_path / "tiktoken.model").write_bytes(tiktoken_file_bytes(ranks))
    assert read_tiktoken_ranks(tmp_path / "tiktoken.model") == ranks
    assert base64.b64decode(tiktoken_file_bytes(ranks).split()[0]) == b"\x00"


# ---- end to end: a Kimi-style checkpoint (tiktoken.model, remote-code config) -> bundle -> inference ----

@pytest.fixture(scope="module")
def kimi_bundle(tmp_path_factory, ranks):
    """A tiny random kimi_k3 checkpoint whose tokenizer is the synthetic TikToken one, built into a bundle."""
    root = tmp_path_factory.mktemp("kimi-e2e")
    synth_hf("kimi_k3", root / "hf", seed=3, dtype="float32", num_layers=2, num_experts=4,
             vocab_size=len(ranks) + 256)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # synth's byte-level BPE
        (root / "hf" / name).unlink(missing_ok=True)
    write_tiktoken_tokenizer(root / "hf", ranks)
    build_bundle(root / "hf", root / "bundle", progress=False)
    return root / "bundle"


def test_build_converts_the_tiktoken_tokenizer(kimi_bundle, ranks):
    record = json.loads((kimi_bundle / "manifest.json").read_text())["tokenizer"]
    assert record["origin"] == "converted" and "converted from tiktoken.model" in record["note"]
    assert {"tokenizer.json", "tokenizer_config.json", "tiktoken.model"} <= set(record["files"])
    assert not (kimi_bundle / "tokenization_kimi.py").exists()
    config = json.loads((kimi_bundle / "tokenizer_config.json").read_text())
    assert "auto_map" not in config and config["tokenizer_class"] != "TikTokenTokenizer"
    loaded = AutoTokenizer.from_pretrained(kimi_bundle)  # what inference does: no trust_remote_code
    assert loaded("你好, world").input_ids == reference_encode(ranks, "你好, world")


def test_inference_generate_runs_on_the_converted_tokenizer(kimi_bundle, ranks, capsys):
    prompt = "你好, world"
    code = inference_main(["generate", "--bundle", str(kimi_bundle), "--dtype", "float32", "--local",
                           "--prompt", prompt, "--max-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"prompt_tokens={len(reference_encode(ranks, prompt))} completion_tokens=4" in err


def test_an_unconvertible_tiktoken_file_is_copied_and_reported(tmp_path, ranks):
    synth_hf("qwen3_moe", tmp_path / "hf", seed=1, num_layers=1, num_experts=4, vocab_size=len(ranks) + 256)
    (tmp_path / "hf" / "tokenizer.json").unlink()
    write_tiktoken_tokenizer(tmp_path / "hf", ranks)
    (tmp_path / "hf" / "tiktoken.model").write_bytes(b"YQ== 0\nYg== 5\n")
    with HFSource(tmp_path / "hf") as source:
        record = source.write_tokenizer(tmp_path / "out")
    assert record["origin"] == "copied" and "tiktoken.model not converted" in record["note"]
    assert "rank 1 is missing" in record["note"] and not (tmp_path / "out" / "tokenizer.json").exists()
