"""PiecewiseStep: a step captured as CUDA graphs split at the experts calls, the calls run eagerly
(host work included) between the pieces on replay. The whole decode path over a real daemon is
tested in test_decode_graph.py (steps after a miss replay the pieces on CUDA)."""

from __future__ import annotations

import pytest
import torch

from inference.engine.decode_graph import StaticDecoder
from inference.engine.piecewise import PiecewiseStep

CUDA = torch.cuda.is_available()


class _Binding:
    segment = None


def _experts(module, hidden_states, top_k_index, top_k_weights):
    """Stands for the acquire path: a host sync on the routing, then device work."""
    chosen = top_k_index.reshape(-1).tolist()  # the host sync a graph could not hold
    return hidden_states * top_k_weights.sum(-1, keepdim=True) + float(sum(chosen))


def _step(x, weights, bindings):
    """Two "layers": dense work, a router, the experts call (or its boundary while recording)."""
    h = x
    for w, binding in zip(weights, bindings):
        h = torch.tanh(h @ w)  # [T, H]
        top_k_weights, top_k_index = torch.topk(torch.softmax(h, -1), 2)  # [T, 2]
        if binding.segment is not None:
            out = binding.segment.boundary(None, h, top_k_index, top_k_weights)
        else:
            out = _experts(None, h, top_k_index, top_k_weights)
        h = h + out
    return h.sum(-1)  # [T]


def test_a_piecewise_step_needs_cuda():
    with pytest.raises(ValueError, match="CUDA graphs.*cpu"):
        PiecewiseStep(torch.device("cpu"))


def test_the_static_decoder_refuses_piecewise_without_capture():
    with pytest.raises(ValueError, match="piecewise.*capture must be on"):
        StaticDecoder(None, None, 8, cache_keyword="past_key_values", capture=False, piecewise=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_replayed_pieces_equal_the_eager_step_on_new_inputs():
    torch.manual_seed(0)
    device = torch.device("cuda")
    x = torch.randn(3, 16, device=device)
    weights = [torch.randn(16, 16, device=device) / 4 for _ in range(3)]
    bindings = [_Binding() for _ in weights]
    _step(x, weights, bindings)  # warm: kernels chosen before capture
    piecewise = PiecewiseStep(device)
    piecewise.record(bindings, lambda: _step(x, weights, bindings))
    assert piecewise.pieces == 4 and len(piecewise.boundaries) == 3
    assert all(b.segment is None for b in bindings)  # recording leaves the bindings as they were
    for trial in range(3):
        x.copy_(torch.randn(3, 16, device=device))  # the static input changes between replays
        got = piecewise.replay(_experts).clone()
        torch.testing.assert_close(got, _step(x, weights, bindings), rtol=0, atol=0, msg=f"trial {trial}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_recording_a_step_without_experts_calls_is_refused():
    device = torch.device("cuda")
    x = torch.randn(4, device=device)
    with pytest.raises(ValueError, match="no experts module"):
        PiecewiseStep(device).record([], lambda: x * 2)
    y = torch.ones(2, device=device)  # the stream left usable: not capturing
    assert y.sum().item() == 2
