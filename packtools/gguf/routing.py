"""Group-limited expert routing as a GGUF file states it and llama.cpp reads it."""

from __future__ import annotations

import gguf

from packtools.gguf.errors import InvalidMetadataError
from packtools.gguf.metadata import Metadata

LLM = gguf.Keys.LLM


def expert_groups(meta: Metadata) -> tuple[int, int]:
    """(groups, groups kept per token) of group-limited routing, as llama.cpp reads the file.

    llama.cpp limits the choice to the best groups only when expert_group_count > 1; otherwise
    expert_group_used_count means nothing. Its converter writes Kimi-Linear's topk_group without a
    group count (it looks for `n_group`, which Moonshot's config spells num_expert_group), so such a
    file routes over all experts, here as there: (1, 1).
    """
    groups = meta.get(LLM.EXPERT_GROUP_COUNT, 0)
    if groups <= 1:
        return 1, 1
    count_key, used_key = meta.key(LLM.EXPERT_GROUP_COUNT), meta.key(LLM.EXPERT_GROUP_USED_COUNT)
    experts = meta.require(LLM.EXPERT_COUNT)
    if experts % groups:
        raise InvalidMetadataError(meta.path, count_key, groups,
                                   f"the {experts} experts do not split into equal groups")
    used = meta.get(LLM.EXPERT_GROUP_USED_COUNT)
    if used is None or not 1 <= used <= groups:
        raise InvalidMetadataError(meta.path, used_key, used, f"group-limited routing keeps between 1 and "
                                                              f"{count_key}={groups} groups")
    return groups, used
