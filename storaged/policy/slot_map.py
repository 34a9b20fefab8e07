"""Where each (model, layer, expert) has its entry in the arena's slot map.

The slot map is an int32 array published inside the arena: entry i holds the slot of the object
it stands for, or -1 when that object is not resident (or is about to be overwritten). Clients
read it on the device to find hits without asking the daemon; the daemon writes it. One row of
`experts_per_layer` entries per MoE layer, models one after another in configuration order:

    index(model, layer, expert) = base[model] + ordinal(layer) * experts_per_layer[model] + expert

where ordinal is the layer's position among the model's MoE layers (ascending).
"""

from __future__ import annotations

from collections.abc import Mapping

from storaged.policy.keys import ExpertKey, ModelLayout

ABSENT = -1  # entry value of an object that is not resident


class SlotMapLayout:
    """The entry index of every served object; pure arithmetic, built once at start-up."""

    def __init__(self, models: Mapping[int, ModelLayout]):
        self._bases: dict[int, int] = {}
        self._ordinals: dict[int, dict[int, int]] = {}
        self._widths: dict[int, int] = {}
        entries = 0
        for model in sorted(models):
            layout = models[model]
            layers = sorted(layout.moe_layers)
            self._bases[model] = entries
            self._ordinals[model] = {layer: i for i, layer in enumerate(layers)}
            self._widths[model] = layout.experts_per_layer
            entries += len(layers) * layout.experts_per_layer
        self.entries = entries

    def index(self, key: ExpertKey) -> int:
        return (self._bases[key.model] + self._ordinals[key.model][key.layer] * self._widths[key.model]
                + key.expert)

    def model_base(self, model: int) -> int:
        """Index of the model's first entry (its first MoE layer's expert 0)."""
        return self._bases[model]

    def layers(self, model: int) -> tuple[int, ...]:
        """The model's MoE layers in row order."""
        return tuple(self._ordinals[model])
