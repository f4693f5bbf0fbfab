"""The model-wide switches over the packed weights of every ``Linear`` (``linear.py``) in a model: packing
on or off, the copies marked stale or dropped, the plain weights released, and every weight read back as
values where its packed copy is its one store."""

from __future__ import annotations

import torch
from torch import nn

from aioengine.model.linear import Linear


def set_weight_prepack(model: nn.Module, hint: int | None) -> int:
    """Turns oneDNN packing of every ``Linear`` on (reordered now) or off (None), and brings each greedy screen
    that greedy steps read up to its weight (``Linear.refresh_greedy_screen``); returns bytes packed.

    A layer already packed for this hint from its current weight (a weight write packs each layer as its
    weight is completed, ``LlamaForCausalLM.weight_written``) keeps its copy."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            if not (hint is not None and module.prepack_hint == hint and module.packed_current()):
                if module.prepack_hint != hint:
                    module.drop_packed()  # a copy for another hint has another layout (or packing goes off)
                module.prepack_hint = hint
                if hint is not None:
                    total += module.pack()
            module.refresh_greedy_screen()
    return total


def drop_packed_weights(model: nn.Module, keep_values: bool = True) -> None:
    """Frees every packed copy (they come back on the next forward, or ``set_weight_prepack``); see
    ``Linear.drop_packed`` for ``keep_values``."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.drop_packed(keep_values)


def release_plain_weights(model: nn.Module, release: bool) -> None:
    """Sets ``keep_plain`` of every ``Linear``: off (``release``) where the layer owns its weight alone, on
    elsewhere. A weight held by another module too (a tied LM head's embedding) always stays plain."""
    holders: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        holders[id(param)] = holders.get(id(param), 0) + 1
    for module in model.modules():
        if isinstance(module, Linear):
            module.keep_plain = not (release and holders.get(id(module.weight), 0) == 1)


def released_linears(model: nn.Module) -> dict[int, Linear]:
    """The layers whose packed copy is their weight's one store (``Linear.plain_released``), by the id of
    their placeholder parameter."""
    return {id(m.weight): m for m in model.modules() if isinstance(m, Linear) and m.plain_released}


def dense_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name with its values: a released weight read back from its packed copy. What code
    that reads weights uses, instead of ``named_parameters()``."""
    dense = released_linears(model)
    return {name: dense[id(p)].dense_weight() if id(p) in dense else p.detach() for name, p in model.named_parameters()}


def mark_packed_weights_stale(model: nn.Module) -> None:
    """Marks every packed copy stale, keeping its memory: rebuilt (in place where the layout is known) on
    the next forward, ``weight_written`` or ``set_weight_prepack``."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.mark_packed_stale()
