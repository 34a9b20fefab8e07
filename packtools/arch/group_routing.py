"""Group-limited routing settings a transformers router can run (shared by the architecture
records' routing checks; packtools.arch.routing applies them)."""

from __future__ import annotations

from transformers import PretrainedConfig

from packtools.arch.errors import UnrunnableConfig
from packtools.arch.spec import ArchSpec


def check_groups(config: PretrainedConfig, spec: ArchSpec, *, group_key: str, min_group_size: int) -> None:
    """Refuse group settings the router cannot honour. `group_key`: the config.json key of the group
    count (transformers aliases it as `n_group`); `min_group_size`: the experts a group's score reads."""
    experts, top_k = spec.num_experts(config), spec.top_k(config)
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


def top2_group_score(group_key: str):
    """The check of a router that scores a group by the sum of its two best experts (DeepSeek-V3's
    and the Kimi routers' topk(2) per group)."""

    def check(config: PretrainedConfig, spec: ArchSpec) -> None:
        check_groups(config, spec, group_key=group_key, min_group_size=2)

    return check
