"""Continuous batching: a request's tokens do not depend on what else runs in the batch, for every
architecture we serve; each batch step acquires a MoE layer's experts once for all its sequences;
a forward that fails leaves the others running."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from test_engine_fixtures import FlakyDaemonSource, loaded, qwen_bundle, tiny_bundle  # noqa: F401

from inference.engine import Engine, ExpertSourceUnavailableError, Finished, SamplingParams, TextDelta
from inference.engine.batch import BatchStepper
from inference.engine.generate import ModelRunner
from inference.engine.sequence import Sequence
from inference.experts import LocalPackSource
from inference.experts.binding import experts_modules
from inference.model import load_model
from packtools.arch.registry import ARCHITECTURES

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENGTHS = (5, 9, 13, 3, 21, 7, 11, 17)  # 8 requests, most prompts longer than one chunk
MAX_TOKENS = (12, 7, 12, 3, 12, 9, 12, 5)  # some leave the batch early, the rest run on
CHUNK = 4


class CountingSource(LocalPackSource):
    """The pack read directly, counting acquires per layer (one data-plane request each with storaged)."""

    def __init__(self, bundle, device):
        super().__init__(bundle, device)
        self.acquires = 0
        self.lock = threading.Lock()

    def acquire_rows(self, layer, experts):  # the fused kernels' acquire, and under acquire()
        with self.lock:
            self.acquires += 1
        return super().acquire_rows(layer, experts)


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_together(engine: Engine, requests: list[list[int]]) -> list[Finished]:
    async def one(prompt_ids, max_tokens):
        events = [e async for e in engine.stream(prompt_ids, greedy(max_tokens))]
        assert all(isinstance(e, TextDelta) for e in events[:-1])
        return events[-1]

    async def all_at_once():
        return await asyncio.gather(*(one(p, m) for p, m in zip(requests, MAX_TOKENS)))
    return asyncio.run(all_at_once())


@pytest.mark.parametrize("arch", list(ARCHITECTURES))  # 1-2 s each on an idle 2-core CPU, bundle build included
def test_eight_requests_in_a_batch_each_equal_their_tokens_alone(tmp_path_factory, arch):
    bundle = tiny_bundle(tmp_path_factory, arch)
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=CountingSource) as model:
        engine = Engine.from_loaded(model, max_num_seqs=8, prefill_chunk=CHUNK)
        try:
            requests = prompts(engine.runner.vocab_size)
            alone = [engine.runner.run(p, greedy(m), emit=lambda e: None) for p, m in zip(requests, MAX_TOKENS)]
            source = model.expert_source
            acquires, steps = source.acquires, engine._steps
            together = run_together(engine, requests)
            moe_layers = len(experts_modules(model.model))
            # one acquire per MoE layer per step, whatever the number of sequences in it
            assert source.acquires - acquires == (engine._steps - steps) * moe_layers
        finally:
            engine.close()
    assert [f.token_ids for f in together] == [f.token_ids for f in alone]
    assert [f.text for f in together] == [f.text for f in alone]
    assert [len(f.token_ids) for f in together] == list(MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "kimi_linear"])
def test_a_batch_runs_on_cuda_with_one_acquire_per_layer_and_step(tmp_path_factory, arch):
    """bfloat16 on the fused kernels: every request runs to its length, the batch shares each MoE
    layer's acquire. Tokens are not compared with each request alone: in bfloat16 the batch's
    grouped kernels sum in another order than one sequence's (the float32 CPU test compares them)."""
    bundle = tiny_bundle(tmp_path_factory, arch)
    with load_model(bundle, device="cuda", dtype=torch.bfloat16, expert_source=CountingSource,
                    experts_compute="fused") as model:
        engine = Engine.from_loaded(model, max_num_seqs=8, prefill_chunk=CHUNK)
        try:
            requests = prompts(engine.runner.vocab_size)
            source = model.expert_source
            acquires, steps = source.acquires, engine._steps
            together = run_together(engine, requests)
            moe_layers = len(experts_modules(model.model))
            assert source.acquires - acquires == (engine._steps - steps) * moe_layers
            assert engine._steps - steps < sum(MAX_TOKENS)  # sequences shared steps
        finally:
            engine.close()
    assert [len(f.token_ids) for f in together] == list(MAX_TOKENS)


def test_steps_overlap_and_the_batch_never_exceeds_max_num_seqs(tmp_path_factory):
    bundle = tiny_bundle(tmp_path_factory, "qwen3_moe")
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as model:
        engine = Engine.from_loaded(model, max_num_seqs=3, prefill_chunk=CHUNK)
        sizes = []
        step = engine._scheduler.stepper.step
        engine._scheduler.stepper.step = lambda sequences: sizes.append(len(sequences)) or step(sequences)
        try:
            requests = prompts(engine.runner.vocab_size)
            together = run_together(engine, requests)
        finally:
            engine.close()
    assert [len(f.token_ids) for f in together] == list(MAX_TOKENS)
    assert max(sizes) == 3  # full, never more
    # 8 requests at most 3 at a time take fewer steps than one after another
    alone_steps = sum(m + -(-n // CHUNK) - 1 for n, m in zip(PROMPT_LENGTHS, MAX_TOKENS))
    assert len(sizes) < alone_steps


class FailingSequence:
    """A sequence whose forward fails before reaching any MoE layer."""

    static = None

    def forward(self):
        raise RuntimeError("this forward fails")


def test_a_failing_forward_leaves_and_the_others_finish_their_step(loaded):
    stepper = BatchStepper(loaded.model, 3)
    try:
        runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None)
        ok = [runner.sequence([1, 5, 9, 12], greedy(4), emit=lambda e: None, prefill_chunk=2) for _ in range(2)]
        bad = FailingSequence()
        failed = stepper.step([ok[0], bad, ok[1]])
        assert list(failed) == [bad] and "fails" in str(failed[bad])
        for sequence in ok:
            sequence.advance()  # the first chunk went through: the rest of the prompt next
            assert sequence.prefilling
    finally:
        stepper.close()


def test_a_sequence_alone_does_not_wait_for_anyone(loaded):
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None)
    stepper = BatchStepper(loaded.model, 2)
    sequence = runner.sequence([1, 5, 9], greedy(3), emit=lambda e: None)
    while not sequence.done:
        assert stepper.step([sequence]) == {}
        sequence.advance()
    assert stepper._pool is None  # no thread pool for one sequence
    expected = runner.run([1, 5, 9], greedy(3), emit=lambda e: None)
    assert tuple(sequence.tokens) == expected.token_ids


def test_the_source_going_away_mid_batch_fails_every_request_of_the_step_then_recovers(qwen_bundle):
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=FlakyDaemonSource) as model:
        engine = Engine.from_loaded(model, max_num_seqs=4)
        source = model.expert_source
        try:
            requests = prompts(engine.runner.vocab_size)[:3]

            async def one(prompt_ids):
                try:
                    return [e async for e in engine.stream(prompt_ids, greedy(40))]
                except ExpertSourceUnavailableError as exc:
                    return exc

            async def all_at_once():
                return await asyncio.gather(*(one(p) for p in requests))
            source.fail_after = source.acquires + 2 * 6  # two MoE layers: six steps succeed
            outcomes = asyncio.run(all_at_once())
            assert all(isinstance(o, ExpertSourceUnavailableError) for o in outcomes), outcomes
            source.up = True
            assert [len(f.token_ids) for f in run_together(engine, prompts(engine.runner.vocab_size))] == \
                list(MAX_TOKENS)
        finally:
            engine.close()


class GatedSource(LocalPackSource):
    """Holds the worker inside a step's first acquire while `gate` is armed, so requests can be
    submitted while a step runs."""

    def __init__(self, bundle, device):
        super().__init__(bundle, device)
        self.armed = False
        self.inside, self.gate = threading.Event(), threading.Event()

    def acquire_rows(self, layer, experts):
        if self.armed:
            self.armed = False
            self.inside.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().acquire_rows(layer, experts)


@pytest.mark.parametrize("max_num_seqs", [8, 4])
def test_requests_that_arrive_during_a_step_join_the_next_step_together(qwen_bundle, max_num_seqs):  # noqa: F811
    """Seven requests submitted while the first one's prefill runs start together in the next
    step (their prefills share its expert reads), as far as max_num_seqs allows; started
    requests keep their order."""
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=GatedSource) as model:
        engine = Engine.from_loaded(model, max_num_seqs=max_num_seqs)
        try:
            source = model.expert_source
            requests = prompts(engine.runner.vocab_size)
            admitted_at: dict[str, int] = {}  # request id → the worker's step that admitted it
            finished = [threading.Event() for _ in requests]
            scheduler = engine._scheduler
            admit = scheduler._admit

            def recording_admit():
                admit()
                for run in scheduler.runs:
                    if run.sequences:
                        admitted_at.setdefault(run.job.request_id, engine._steps)
            scheduler._admit = recording_admit

            def sink(index):
                return lambda event: isinstance(event, Finished) and finished[index].set()

            source.armed = True
            steps = engine._steps
            engine.submit(requests[0], greedy(4), sink(0), request_id="0")
            assert source.inside.wait(30)  # the first request's prefill is inside its step
            for i, p in enumerate(requests[1:], start=1):
                engine.submit(p, greedy(4), sink(i), request_id=str(i))
            source.gate.set()
            assert all(done.wait(60) for done in finished)
        finally:
            engine.close()
    # the first request starts in step 1; as many others as fit start together in step 2, the rest
    # as places free up, in submission order
    started = [admitted_at[str(i)] - steps for i in range(8)]
    assert started[0] == 1
    assert started[1:max_num_seqs] == [2] * (max_num_seqs - 1)
    assert started == sorted(started)


class EagerStaticDecoder:
    """Stands in for the CUDA-graph StaticDecoder on the CPU: the same start/step/fits interface,
    computed by the model's eager forward into a cache of its own (the static decoder's tokens equal
    the eager decode's, tests/inference/test_decode_graph.py, so only the hand-over is under test)."""

    def __init__(self, runner):
        self.runner, self.cache, self.calls, self.closed = runner, None, 0, False

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        return True

    def start(self, prompt_ids):
        self.calls += 1
        logits, self.cache = self.runner.forward(torch.tensor([prompt_ids]), None)
        return logits

    def step(self, token: int):
        self.calls += 1
        logits, self.cache = self.runner.forward(torch.tensor([[token]]), self.cache)
        return logits

    def launch(self, token):  # never launches ahead: DecodeAhead waits for each step (step())
        return None

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_sequence_leaving_the_static_decoder_refeeds_its_tokens_and_decodes_on(loaded):
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None)
    prompt = prompts(runner.vocab_size)[4]  # 21 tokens
    plain = runner.sequence(prompt, greedy(10), emit=lambda e: None, static=False, prefill_chunk=CHUNK)
    moving = Sequence(runner, prompt, greedy(10), emit=lambda e: None, static=EagerStaticDecoder(runner),
                      prefill_chunk=CHUNK)
    assert not plain.leave_static()  # not on a static decoder: nothing to leave
    with torch.inference_mode():
        while not plain.done:
            plain.forward()
            plain.advance()
        for _ in range(3):  # the prompt in one call, then two decode steps on the static decoder
            moving.forward()
            moving.advance()
        assert len(moving.tokens) == 3 and moving.next_input_len() == 1
        assert moving.leave_static()
        assert not moving.leave_static()
        refeeds = []
        while moving.prefilling:  # prompt + 3 tokens, in chunks, emitting nothing
            refeeds.append(moving.next_input_len())
            moving.forward()
            moving.advance()
        # 24 tokens in chunks of 4; the last chunk's logits gave the 4th token
        assert refeeds == [CHUNK] * 6 and len(moving.tokens) == 4
        while not moving.done:
            moving.forward()
            moving.advance()
    assert moving.tokens == plain.tokens
    assert moving.finish().usage.prompt_tokens == len(prompt)


def test_a_request_on_the_static_decoder_joins_the_batch_when_others_arrive(qwen_bundle):  # noqa: F811
    """The first request is admitted alone (static decoder); the others, submitted during its first
    step, start in the next, and it leaves the static decoder to step with them: every step after
    that is one lockstep batch, and every request's greedy tokens equal its tokens alone."""
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=GatedSource) as model:
        engine = Engine.from_loaded(model, max_num_seqs=8, prefill_chunk=CHUNK)
        try:
            runner, source = engine.runner, model.expert_source
            requests = prompts(runner.vocab_size)
            alone = [runner.run(p, greedy(m), emit=lambda e: None) for p, m in zip(requests, MAX_TOKENS)]
            runner.decoder = EagerStaticDecoder(runner)
            stepper = engine._scheduler.stepper
            static_in_step, step = [], stepper.step
            stepper.step = lambda sequences: static_in_step.append(
                sum(s.static is not None for s in sequences)) or step(sequences)
            metric = ("expertpack_inference_static_decoder_left_total", {"model": engine.metrics.model})
            left = engine.metrics.registry.get_sample_value(*metric) or 0.0
            results: dict[int, Finished] = {}
            finished = [threading.Event() for _ in requests]

            def sink(index):
                def on_event(event):
                    if isinstance(event, Finished):
                        results[index] = event
                        finished[index].set()
                return on_event

            source.armed = True
            engine.submit(requests[0], greedy(MAX_TOKENS[0]), sink(0))
            assert source.inside.wait(30)
            for i, p in enumerate(requests[1:], start=1):
                engine.submit(p, greedy(MAX_TOKENS[i]), sink(i))
            source.gate.set()
            assert all(done.wait(60) for done in finished)
            assert engine.metrics.registry.get_sample_value(*metric) - left == 1
        finally:
            engine.close()
    assert static_in_step[0] == 1 and not any(static_in_step[1:])  # static in its first step only
    assert runner.decoder.calls == 1  # the prompt; every later forward ran in the batch
    assert runner.decoder.closed  # the engine stops the decoder's CPU threads when it closes
    assert [results[i].token_ids for i in range(8)] == [f.token_ids for f in alone]
