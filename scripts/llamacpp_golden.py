"""Regenerate tests/golden/llamacpp: tiny MoE GGUFs made and run by llama.cpp, an independent reference.

Steps (each its own subcommand; `all` runs them in order):
  fetch     pip download the llama-cpp-python 0.3.36 sdist (it vendors llama.cpp, its converter
            convert_hf_to_gguf.py, a newer gguf-py and llama-quantize) and unpack it
  build     cmake build of libllama (shared, CPU) and llama-quantize
  deps      pip install --target the converter's extra deps (sentencepiece) and diskcache
            (llama_cpp's python bindings), outside /work/venv
  hf        tiny random HF checkpoints (packtools.synth) + the synthetic byte-level BPE tokenizer
  convert   llama.cpp's own convert_hf_to_gguf.py --outtype f32, with its vendored gguf-py
  quantize  llama-quantize to the K-quant / MXFP4 cases
  run       llama.cpp (llama_cpp python bindings over the built libllama) evaluates a fixed prompt
            of token ids, then 32 greedy steps; writes the tokens and the logits of every step (and,
            for cases with record_indexer, the lightning indexer's choices: llamacpp_ggml_probe.py)

Usage: /work/venv/bin/python scripts/llamacpp_golden.py all [--work /var/tmp/llamacpp]
Then: /work/venv/bin/python -m pytest tests/inference/test_llamacpp_golden.py -s -q  (results table)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "llamacpp"
SDIST_VERSION = "0.3.36"

# the case tables live beside this script; loaded by path (tests do), its folder is not on sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_cases import (  # noqa: E402
    CASES,
    CONVERTER_CONFIG_KEYS,
    DEEPSEEK_V4_CASES,
    K3_LAYERS,
    K3_USERS_Q2_K,
    KIMI_K3_CASES,
    LONG_PROMPT,
    NARROW,
    NEW_TOKENS,
    OLMOE_MHA,
    PROMPT,
    PROMPTS,
    WIDE,
    Case,
)

# what tests and tests/golden/kimi_tokenizer/regenerate.py read from this module, cases included
__all__ = ["CASES", "CONVERTER_CONFIG_KEYS", "DEEPSEEK_V4_CASES", "K3_LAYERS", "K3_USERS_Q2_K", "KIMI_K3_CASES",
           "LONG_PROMPT", "NARROW", "NEW_TOKENS", "OLMOE_MHA", "PROMPT", "PROMPTS", "WIDE", "Case", "Paths",
           "golden_gguf", "main", "write_checkpoint"]

@dataclasses.dataclass(frozen=True)
class Paths:
    work: Path

    @property
    def sdist(self) -> Path:
        return self.work / f"llama_cpp_python-{SDIST_VERSION}"

    @property
    def llama_cpp(self) -> Path:
        return self.sdist / "vendor" / "llama.cpp"

    @property
    def build(self) -> Path:
        return self.work / "build"

    @property
    def pydeps(self) -> Path:
        return self.work / "pydeps"

    def hf(self, case: Case) -> Path:
        return self.work / "hf" / case.checkpoint

    def f32_gguf(self, case: Case) -> Path:
        return self.work / "gguf" / f"{case.checkpoint}-F32.gguf"


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def fetch(paths: Paths) -> None:
    paths.work.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={SDIST_VERSION}", "-d", paths.work])
    _run(["tar", "xzf", paths.work / f"llama_cpp_python-{SDIST_VERSION}.tar.gz", "-C", paths.work])


def build(paths: Paths) -> None:
    _run(["cmake", "-S", paths.llama_cpp, "-B", paths.build, "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
          "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF"])
    _run(["cmake", "--build", paths.build, "-j2", "--target", "llama", "llama-quantize"])


def deps(paths: Paths) -> None:
    _run([sys.executable, "-m", "pip", "install", "--target", paths.pydeps, "sentencepiece", "diskcache"])


def synthesize_hf(paths: Paths) -> None:
    for case in {c.checkpoint: c for c in CASES}.values():
        out = paths.hf(case)
        shutil.rmtree(out, ignore_errors=True)
        write_checkpoint(case, out)


def write_checkpoint(case: Case, out: Path) -> None:
    """The tiny random HF checkpoint of `case` (deterministic; tests rebuild it to compare with)."""
    if str(REPO) not in sys.path:  # run as a script from anywhere: packtools lives in the repo
        sys.path.insert(0, str(REPO))
    from inference.models import OFFICIAL_CONFIG_LAYOUTS
    from packtools.synth.compressed_tensors import to_compressed_tensors_mxfp4
    from packtools.synth.gguf_models import tiny_random_model
    from packtools.tokenizer_synth import write_tokenizer

    if case.expert_format == "deepseek-v4-official":
        _synthesize_deepseek_v4_official(out, case)
    else:
        model = tiny_random_model(case.arch, seed=5, overrides=case.overrides or None, **case.sizes)
        model.save_pretrained(out)
        write_tokenizer(out, model.config.vocab_size)
        config = json.loads((out / "config.json").read_text())
        if case.arch in OFFICIAL_CONFIG_LAYOUTS:  # e.g. Kimi-K3's multimodal wrapper, as the converter expects
            config = OFFICIAL_CONFIG_LAYOUTS[case.arch](model.config)
        extra = CONVERTER_CONFIG_KEYS.get(case.arch, lambda _: {})(config)
        (out / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
    if case.expert_format == "compressed-tensors-mxfp4":
        to_compressed_tensors_mxfp4(out)


def _synthesize_deepseek_v4_official(out: Path, case: Case) -> None:
    from packtools.synth.deepseek_v4_official import synth_official

    synth_official(out, seed=5, **case.sizes)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **case.overrides}, indent=2) + "\n")


def _vendored_env(paths: Paths) -> dict:
    # the vendored gguf-py must shadow /work/venv's gguf 0.19.0; PYTHONPATH precedes site-packages
    path = [paths.llama_cpp, paths.llama_cpp / "gguf-py", paths.sdist, paths.pydeps]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path)), "LLAMA_CPP_LIB_PATH": str(paths.build / "bin")}


def convert(paths: Paths) -> None:
    for case in {c.checkpoint: c for c in CASES}.values():
        paths.f32_gguf(case).parent.mkdir(parents=True, exist_ok=True)
        flags = [DSV4_DENSE_BF16_FLAG] if case.expert_format == "deepseek-v4-official" else []
        flags += case.converter_args
        _run([sys.executable, __file__, "_convert", paths.llama_cpp, paths.hf(case), "--outfile",
              paths.f32_gguf(case), "--outtype", "f32", *flags], env=_vendored_env(paths))


def _convert_entry(llama_cpp: str, converter_args: list[str]) -> None:
    """convert_hf_to_gguf.py, told that the synthetic tokenizer's pre-tokenizer is GPT-2's.

    The converter identifies BPE pre-tokenizers by a hash of their output on a fixed text, a hash
    that depends on the vocabulary; a freshly trained vocabulary is never in its table. Ours is
    ByteLevel(add_prefix_space=False) with the GPT-2 split regex, i.e. exactly "gpt-2". Only an
    unrecognised hash falls back; a recognised one keeps the converter's answer.
    """
    import runpy

    import conversion.base as base  # noqa: PLC0415  (only importable with the vendored paths)

    recognise = base.TextModel.get_vocab_base_pre

    def recognise_or_gpt2(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = recognise_or_gpt2
    _glm_vocab_or_gpt2(base)
    _sentencepiece_vocab_or_gpt2()
    if DSV4_DENSE_BF16_FLAG in converter_args:
        converter_args = [a for a in converter_args if a != DSV4_DENSE_BF16_FLAG]
        _keep_dsv4_fp8_dense_bf16()
    script = str(Path(llama_cpp) / "convert_hf_to_gguf.py")
    sys.argv = [script, *converter_args]
    runpy.run_path(script, run_name="__main__")


def _glm_vocab_or_gpt2(base) -> None:
    """GLM's vocab step looks up GLM's own special tokens ([gMASK], <|user|>, <|observation|>) by
    name; the synthetic tokenizer has none, so it writes the same byte-level BPE vocabulary the
    generic GPT-2 way. Token ids, and so the comparison, are untouched; a real GLM tokenizer keeps
    the converter's own path."""
    glm_vocab = base.TextModel._set_vocab_glm

    def glm_or_gpt2(self) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        if "[gMASK]" in AutoTokenizer.from_pretrained(self.dir_model).get_added_vocab():
            return glm_vocab(self)
        return self._set_vocab_gpt2()

    base.TextModel._set_vocab_glm = glm_or_gpt2


def _sentencepiece_vocab_or_gpt2() -> None:
    """ERNIE-4.5's vocab step reads a SentencePiece tokenizer.model; the synthetic tokenizer is a
    byte-level BPE tokenizer.json, which the converter writes the GPT-2 way (token ids unchanged).
    A checkpoint with a tokenizer.model keeps the converter's own path."""
    from conversion.ernie import Ernie4_5Model  # noqa: PLC0415  (only importable with the vendored paths)

    ernie_vocab = Ernie4_5Model.set_vocab

    def ernie_or_gpt2(self) -> None:
        if (self.dir_model / "tokenizer.model").is_file():
            return ernie_vocab(self)
        return self._set_vocab_gpt2()

    Ernie4_5Model.set_vocab = ernie_or_gpt2
    _tiktoken_vocab_or_gpt2()


def _tiktoken_vocab_or_gpt2() -> None:
    """Hunyuan's vocab step rebuilds merges from Tencent's tiktoken tokenizer (`mergeable_ranks`)
    and pins BOS to id 127959; the synthetic byte-level BPE tokenizer.json is written the GPT-2 way
    (token ids unchanged). A tokenizer with mergeable_ranks keeps the converter's own path."""
    from conversion.hunyuan import HunYuanMoEModel  # noqa: PLC0415

    hunyuan_vocab = HunYuanMoEModel.set_vocab

    def hunyuan_or_gpt2(self) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        if hasattr(AutoTokenizer.from_pretrained(self.dir_model), "mergeable_ranks"):
            return hunyuan_vocab(self)
        return self._set_vocab_gpt2()

    HunYuanMoEModel.set_vocab = hunyuan_or_gpt2


DSV4_DENSE_BF16_FLAG = "--dsv4-fp8-dense-as-bf16"


def _keep_dsv4_fp8_dense_bf16() -> None:
    """DeepseekV4Model writes its dequantized FP8 dense weights as Q8_0 whatever --outtype says;
    BF16 holds them exactly (an e4m3 value times a power of two within BF16's range, which
    packtools.sources.dsv4_formats checks), so the comparison stays at float32 rounding. Only the
    FP8-dequantized tensors change; the rest keeps the converter's choice."""
    from conversion.deepseek import DeepseekV4Model  # noqa: PLC0415
    from gguf import GGMLQuantizationType  # noqa: PLC0415  (the vendored gguf-py)

    converter_choice = DeepseekV4Model.tensor_force_quant

    def fp8_dense_as_bf16(self, name, new_name, bid, n_dims):
        if name in self._dsv4_fp8_dequantized:
            return GGMLQuantizationType.BF16
        return converter_choice(self, name, new_name, bid, n_dims)

    DeepseekV4Model.tensor_force_quant = fp8_dense_as_bf16


def golden_gguf(case: Case) -> Path:
    return GOLDEN / f"{case.name}.gguf"


def quantize(paths: Paths) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if case.quant == "F32" or case.expert_format != "float":  # the converter's output is the case
            shutil.copyfile(paths.f32_gguf(case), golden_gguf(case))
        else:
            _run([paths.build / "bin" / "llama-quantize", *case.quantize_args, paths.f32_gguf(case), golden_gguf(case),
                  case.quant, "1"], env=_vendored_env(paths), stdout=subprocess.DEVNULL)


def run_llama(paths: Paths) -> None:
    for case in CASES:
        _run([sys.executable, __file__, "_run", golden_gguf(case), GOLDEN / f"{case.name}.json", case.prompt,
              "record-indexer" if case.record_indexer else "-"], env=_vendored_env(paths))


def _run_entry(gguf_path: str, out_json: str, prompt_name: str = "short", indexer: str = "-") -> None:
    """Prompt, then NEW_TOKENS greedy steps; logits row i predicts generated token i."""
    import numpy as np
    from llama_cpp import Llama, __version__

    from llamacpp_ggml_probe import EvalRecorder  # noqa: PLC0415  (next to this script)

    recorder = EvalRecorder(INDEXER_NODE_NAME.fullmatch) if indexer == "record-indexer" else None
    f32 = 0  # GGML_TYPE_F32: the default F16 KV cache alone moves logits by ~5e-4 relative
    prompt = PROMPTS[prompt_name]
    n_ctx = 128 if len(prompt) + NEW_TOKENS <= 128 else 256
    with recorder.installed() if recorder else contextlib.nullcontext():
        llm = Llama(gguf_path, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=1, type_k=f32, type_v=f32,
                    flash_attn=False, verbose=False)
    llm.eval(prompt)
    tokens, rows = [], []
    for _ in range(NEW_TOKENS):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)  # [vocab]
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        llm.eval([tokens[-1]])
    out = Path(out_json)
    np.save(out.with_suffix(".logits.npy"), np.stack(rows))  # [NEW_TOKENS, vocab] float32
    record = {"gguf": Path(gguf_path).name, "gguf_sha256": hashlib.sha256(Path(gguf_path).read_bytes()).hexdigest(),
              "llama_cpp_python": __version__, "llama_cpp_commit": _llama_cpp_commit(),
              "prompt": prompt, "tokens": tokens, "logits": out.with_suffix(".logits.npy").name}
    if recorder:
        record["indexer_top_k"] = _save_indexer_choices(recorder, out, len(prompt) + NEW_TOKENS)
    out.write_text(json.dumps(record, indent=1) + "\n")


INDEXER_NODE = "lid_top_k-"  # deepseek4.cpp build_lid_top_k: cb(top_k, "lid_top_k", il)
INDEXER_NODE_NAME = re.compile(re.escape(INDEXER_NODE) + r"\d+")  # not its "... (view)" children


class IndexerRecordError(RuntimeError):
    pass


def _save_indexer_choices(recorder, out: Path, n_positions: int) -> dict:
    """llama.cpp's chosen compressed entries, int32 [layers, positions, index_topk]; row p is the choice
    of the query at position p (prompt, then each greedy token). Entries a query cannot see yet (early
    positions) are whatever ggml_top_k picked among -inf scores; llama.cpp masks them afterwards."""
    import numpy as np

    layers = sorted({int(name.removeprefix(INDEXER_NODE)) for name, _ in recorder.captured})
    per_layer = []
    for layer in layers:
        evals = recorder.take(f"{INDEXER_NODE}{layer}")  # one [1, 1, tokens, k] per decode call
        per_layer.append(np.concatenate([array.reshape(-1, array.shape[-1]) for array in evals]))
        if per_layer[-1].shape[0] != n_positions:
            raise IndexerRecordError(f"{out.name}: layer {layer} has {per_layer[-1].shape[0]} indexer rows "
                                     f"for {n_positions} evaluated positions")
    path = out.with_suffix(".indexer.npy")
    np.save(path, np.stack(per_layer).astype(np.int32))
    return {"layers": layers, "choices": path.name}


def _llama_cpp_commit() -> str:
    # libllama exposes no commit; the build's generated build-info.cpp records it
    build_info = Path(os.environ["LLAMA_CPP_LIB_PATH"]).parent / "common" / "build-info.cpp"
    for line in build_info.read_text().splitlines() if build_info.exists() else []:
        if "LLAMA_COMMIT =" in line:
            return line.split('"')[1]
    return "unknown"


STEPS = {"fetch": fetch, "build": build, "deps": deps, "hf": synthesize_hf, "convert": convert,
         "quantize": quantize, "run": run_llama}


def main(argv: list[str]) -> None:
    if argv and argv[0] == "_convert":
        return _convert_entry(argv[1], argv[2:])
    if argv and argv[0] == "_run":
        return _run_entry(*argv[1:5])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=[*STEPS, "all"])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/llamacpp"), help="build and scratch directory")
    parser.add_argument("--arch", action="append", default=None,
                        help="only the cases of this model_type (repeatable); the other goldens stay untouched")
    args = parser.parse_args(argv)
    if args.arch:  # the steps read the module's CASES
        CASES[:] = [case for case in CASES if case.arch in args.arch]
    paths = Paths(args.work)
    for name, step in STEPS.items():
        if args.step in (name, "all"):
            step(paths)


if __name__ == "__main__":
    main(sys.argv[1:])
