"""Routing settings a config's transformers router can run as the config says.

transformers builds group-limited routers without checking their settings. A config that keeps
more groups than it has (`topk_group > n_group`), whose experts do not split evenly into groups, or
whose kept groups hold fewer experts than top-k builds fine, then fails at the first forward
("selected index k out of range") or routes to experts it masked out. DeepSeek-V2's router knows
only two top-k methods and never renormalises the top-k weights. `check_routing` refuses such
configs, naming the config.json key, where a bundle is built and where one is loaded.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from packtools.arch.errors import UnrunnableConfig
from packtools.arch.registry import get_arch

# config.json key of the group count (transformers aliases Moonshot's num_expert_group as n_group)
GROUP_COUNT_KEY = {"deepseek_v3": "n_group", "deepseek_v2": "n_group",
                   "kimi_linear": "num_expert_group", "kimi_k3": "num_expert_group"}
# DeepSeek-V3 and the Kimi routers score a group by the sum of its two best experts (topk(2) per group)
_TOP2_GROUP_SCORE = frozenset({"deepseek_v3", "kimi_linear", "kimi_k3"})
DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def check_routing(config: PretrainedConfig) -> None:
    """Raise UnrunnableConfig if the router of `config`'s model cannot route as the config says."""
    model_type = config.model_type
    if model_type == "deepseek_v2":
        _check_deepseek_v2(config)
    elif model_type in _TOP2_GROUP_SCORE:
        _check_groups(config, min_group_size=2)


def _check_deepseek_v2(config: PretrainedConfig) -> None:
    if config.topk_method not in DEEPSEEK_V2_TOPK_METHODS:
        raise UnrunnableConfig(config.model_type, "topk_method", config.topk_method,
                               f"transformers' DeepseekV2 router implements only {', '.join(DEEPSEEK_V2_TOPK_METHODS)}")
    if config.norm_topk_prob:
        raise UnrunnableConfig(config.model_type, "norm_topk_prob", config.norm_topk_prob,
                               "transformers' DeepseekV2 router never renormalises the top-k weights")
    if config.topk_method == "group_limited_greedy":
        # a group's score is its best expert (max), so a group may hold a single expert
        _check_groups(config, min_group_size=1)


def _check_groups(config: PretrainedConfig, *, min_group_size: int) -> None:
    spec = get_arch(config.model_type)
    experts, top_k = spec.num_experts(config), spec.top_k(config)
    group_key = GROUP_COUNT_KEY[config.model_type]
    n_group, topk_group = config.n_group, config.topk_group

    def refuse(key: str, value: object, reason: str) -> None:
        raise UnrunnableConfig(config.model_type, key, value, reason)

    if not isinstance(n_group, int) or n_group < 1 or experts % n_group:
        refuse(group_key, n_group, f"the {experts} routed experts must split into that many equal groups")
    per_group = experts // n_group
    if per_group < min_group_size:
        refuse(group_key, n_group, f"groups of {per_group} expert; the router scores a group by its "
                                   f"{min_group_size} best experts")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        refuse("topk_group", topk_group, f"the router keeps between 1 and {group_key}={n_group} groups")
    if topk_group * per_group < top_k:
        refuse("topk_group", topk_group, f"{topk_group} group(s) of {per_group} experts hold fewer than the "
                                         f"{top_k} experts each token routes to")
