"""Routing settings a config's transformers router can run as the config says.

transformers builds group-limited routers without checking their settings. A config that keeps
more groups than it has (`topk_group > n_group`), whose experts do not split evenly into groups, or
whose kept groups hold fewer experts than top-k builds fine, then fails at the first forward
("selected index k out of range") or routes to experts it masked out. DeepSeek-V2's router knows
only two top-k methods and never renormalises the top-k weights. `check_routing` refuses such
configs, naming the config.json key, where a bundle is built and where one is loaded; each
architecture's record says what its router needs (packtools.arch.group_routing).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from packtools.arch.registry import get_architecture


def check_routing(config: PretrainedConfig) -> None:
    """Raise UnrunnableConfig if the router of `config`'s model cannot route as the config says."""
    record = get_architecture(config.model_type)
    if record.check_routing is not None:
        record.check_routing(config, record.spec)
