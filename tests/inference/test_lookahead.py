"""Lookahead hints through a real model on the CPU: predicted by the next layer's router, scored by
what that layer then used, and withheld while they miss (inference.experts.hint_policy)."""

from __future__ import annotations

import pytest
import torch
from test_model_fixtures import make_case

from inference.experts import LocalPackSource, experts_modules
from inference.model import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 4  # three predictors: layers 0, 1, 2 hint layers 1, 2, 3
STEPS = 30


class HintRecordingSource:
    """A real LocalPackSource that takes prefetch hints and records them (and every acquire)."""

    def __init__(self, bundle, device):
        self.inner = LocalPackSource(bundle, device)
        self.hints: list[tuple[int, list[int]]] = []
        self.acquired: list[tuple[int, list[int]]] = []

    def layout(self, layer):
        return self.inner.layout(layer)

    def acquire(self, layer, experts):
        self.acquired.append((layer, list(experts)))
        return self.inner.acquire(layer, experts)

    def prefetch(self, layer, experts):
        self.hints.append((layer, list(experts)))


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    return make_case("qwen3_moe", tmp_path_factory.mktemp("lookahead") / "b", num_layers=LAYERS)[1]


def predictors(loaded):
    return [module.expertpack_binding.predict for _, module in experts_modules(loaded.model).values()
            if module.expertpack_binding.predict is not None]


def decode_steps(loaded, steps: int, seed: int = 1) -> list[int]:
    """`steps` one-token forwards; the hints each one sent."""
    generator = torch.Generator().manual_seed(seed)
    sent = []
    with torch.no_grad():
        for _ in range(steps):
            before = len(loaded.expert_source.hints)
            loaded.model(torch.randint(0, 200, (1, 1), generator=generator))
            sent.append(len(loaded.expert_source.hints) - before)
    return sent


def test_hints_name_the_next_layer_and_every_prediction_is_scored(bundle_dir):
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=HintRecordingSource, lookahead=2,
                    lookahead_min_precision=0.0) as loaded:
        assert [p.next_layer for p in predictors(loaded)] == [1, 2, 3]
        assert decode_steps(loaded, STEPS) == [3] * STEPS  # min_precision 0: every hint goes out
        stats = loaded.hint_policy.stats()
        assert stats.hints_sent == len(loaded.expert_source.hints) == 3 * STEPS
        assert stats.hinted_experts == sum(len(experts) for _, experts in loaded.expert_source.hints)
        assert stats.buckets["single"].observations == 3 * STEPS  # each hinted layer reported its experts
        assert {layer for layer, _ in loaded.expert_source.hints} == {1, 2, 3}
        # the hints are the router's top-2 of the previous layer's input: at most 2 per token
        assert all(1 <= len(experts) <= 2 for _, experts in loaded.expert_source.hints)


@pytest.mark.parametrize("predictor", ["real router", "scrambled router"])
def test_hints_flow_while_they_hit_and_stop_while_they_miss(bundle_dir, predictor):
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=HintRecordingSource, lookahead=2,
                    lookahead_min_precision=0.3) as loaded:
        if predictor == "scrambled router":
            for p in predictors(loaded):
                p.weight = -p.weight  # picks the experts the router likes least
        sent = decode_steps(loaded, STEPS)
        stats = loaded.hint_policy.stats()
        single = stats.buckets["single"]
        assert single.observations == 3 * STEPS  # scored whether sent or withheld
        assert sent[:2] == [3, 3]  # optimistic until the policy has scored 8 predictions (the layers' together)
        if predictor == "real router":
            assert single.precision >= 0.3 and single.sending
            assert sent == [3] * STEPS and stats.withheld == 0
        else:
            assert single.precision < 0.3 and not single.sending
            assert sent[-10:] == [0] * 10 and stats.withheld == 3 * STEPS - 8
            assert stats.hints_sent == 8 and stats.hints_sent + stats.withheld == 3 * STEPS
            # a prefill chunk is another bucket: still optimistic, its hints go out
            before = len(loaded.expert_source.hints)
            with torch.no_grad():
                loaded.model(torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(2)))
            assert len(loaded.expert_source.hints) - before == 3


def test_withheld_hints_change_nothing_but_the_prefetches(bundle_dir):
    """The same tokens and acquires with hints withheld as with every hint sent."""
    logits, acquired = [], []
    for min_precision in (0.0, 1.0):
        with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=HintRecordingSource,
                        lookahead=2, lookahead_min_precision=min_precision) as loaded:
            with torch.no_grad():
                logits.append(loaded.model(torch.tensor([[5, 9, 31, 7]])).logits)
            acquired.append(loaded.expert_source.acquired)
    assert torch.equal(logits[0], logits[1]) and acquired[0] == acquired[1]


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.5"])
def test_load_model_refuses_a_bad_min_precision(bundle_dir, value):
    with pytest.raises(ValueError, match="lookahead_min_precision"):
        load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=HintRecordingSource, lookahead=2,
                   lookahead_min_precision=value)


def test_the_engine_exports_the_hint_counters_as_metrics(tmp_path):
    from inference.engine import Engine, SamplingParams
    from inference.engine.metrics import EngineMetrics

    bundle = make_case("qwen3_moe", tmp_path / "b", tokenizer=True, num_layers=LAYERS)[1]
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=HintRecordingSource, lookahead=2,
                    lookahead_min_precision=0.0) as loaded:
        metrics = EngineMetrics(model="m")
        engine = Engine.from_loaded(loaded, metrics=metrics)
        try:
            list(engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        finally:
            engine.close()
        stats = loaded.hint_policy.stats()

        def value(name, **labels):
            return metrics.registry.get_sample_value(f"expertpack_inference_{name}", {"model": "m", **labels})

        assert stats.hints_sent > 0
        assert value("lookahead_hints_total") == stats.hints_sent == len(loaded.expert_source.hints)
        assert value("lookahead_hinted_experts_total") == stats.hinted_experts
        assert value("lookahead_withheld_total") == 0
        assert value("lookahead_precision", width="single") == pytest.approx(stats.buckets["single"].precision)
        assert value("lookahead_sending", width="single") == 1.0
        assert b"expertpack_inference_lookahead_hints_total" in metrics.exposition()
