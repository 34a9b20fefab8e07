"""inference.engine.static_cache: the batched reset leaves what transformers' reset leaves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, StaticCache

from inference.engine.generate import _cache_keyword
from inference.engine.static_cache import reset_cache, set_lengths
from packtools.arch import tiny_config


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _filled_cache(arch: str, layers: int = 3) -> StaticCache:
    """A static cache after a 5-token prefill of a tiny `arch` model (every layer initialized)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers=layers)).eval()
    cache = StaticCache(config=model.config, max_cache_len=16)
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(5).view(1, 5), use_cache=True,
              **{_cache_keyword(model): cache})
    return cache


def _state(cache: StaticCache) -> list[dict]:
    return copy.deepcopy([vars(layer) for layer in cache.layers])


def _equal(left, right) -> bool:
    """Equal values, tensors (dtype, shape, contents) and containers of them included."""
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and left.dtype == right.dtype
                and torch.equal(left, right))
    if isinstance(left, (list, tuple)):
        return type(left) is type(right) and len(left) == len(right) and all(map(_equal, left, right))
    if isinstance(left, dict):
        return isinstance(right, dict) and left.keys() == right.keys() and all(_equal(left[k], right[k]) for k in left)
    return left == right


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for index, (left, right) in enumerate(zip(a, b)):
        assert left.keys() == right.keys(), index
        for name in left:
            assert _equal(left[name], right[name]), (index, name)


# qwen3_moe: every layer static; gpt_oss: sliding-window layers among them; qwen3_next: linear
# attention layers, whose reset is their own
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_the_batched_reset_leaves_what_transformers_reset_leaves(arch):
    cache = _filled_cache(arch)
    assert any(bool(layer.cumulative_length != 0) for layer in cache.layers if hasattr(layer, "cumulative_length"))
    expected = copy.deepcopy(cache)
    expected.reset()
    reset_cache(cache)
    _assert_same(_state(cache), _state(expected))


def test_static_layers_reset_in_one_operation_not_three_a_layer():
    cache = _filled_cache("qwen3_moe", layers=4)
    with CountOps() as batched:
        reset_cache(cache)
    cache = _filled_cache("qwen3_moe", layers=4)
    with CountOps() as plain:
        cache.reset()
    assert batched.ops == ["aten._foreach_zero_"]
    assert plain.ops.count("aten.zero_") == 3 * 4


def test_an_uninitialized_layer_has_only_its_length_zeroed():
    model_config = tiny_config("qwen3_moe", num_layers=2)
    cache = StaticCache(config=model_config, max_cache_len=8)
    for layer in cache.layers:
        layer.cumulative_length.fill_(3)
    reset_cache(cache)
    assert all(int(layer.cumulative_length) == 0 and not layer.is_initialized for layer in cache.layers)


def test_set_lengths_sets_every_layer():
    cache = _filled_cache("qwen3_moe")
    set_lengths(cache, 11)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [11] * len(cache.layers)
