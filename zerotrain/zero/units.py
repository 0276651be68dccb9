"""Stage 3's gather units: the module subtrees whose parameters are gathered together.

[Note: choosing gather units]
A unit is gathered before its module runs (forward, and again before its backward) and released
after, so the units bound the live working set. The blocks of a network are the natural units:
every child of an ``nn.ModuleList`` (the outermost lists only) that holds parameters is a unit.
Everything else belongs
to the *root* unit, gathered for the whole forward and backward of the step: embeddings, heads,
final norms, and any parameter referenced from more than one unit (tied embedding and LM head,
a parameter read with ``F.linear(x, self.emb.weight)`` in a parent's forward). That keeps code
that reads parameters outside their own module's forward correct without registration; a
parameter read by a block that does not own it must be registered
(``zerotrain.zero.register_external_parameter``), and then joins the root unit too.

A module marked as a ZeRO-3 leaf (DeepSpeed's ``set_z3_leaf_modules``) is a unit as a whole
wherever it sits outside another unit: none of its descendants (its own lists included) is
one. Its parameters are then gathered together on entry to its forward and held through its
backward, which a Mixture-of-Experts block needs when its experts are the outermost list: as
units of their own, ranks routing their tokens to different experts would gather different
units, collectives that do not match. Inside a block that is already a unit, the mark changes
nothing.
"""

from __future__ import annotations

from torch import nn

from zerotrain.zero.init import external_parameters

LEAF_FLAG = "_z3_leaf"
"""The attribute that marks a module as a ZeRO-3 leaf (DeepSpeed's name, which client code
also sets by hand)."""


def is_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, LEAF_FLAG, False))


def find_unit_modules(model: nn.Module) -> list[nn.Module]:
    """The block modules of ``model`` in registration order (the root is not included)."""
    units: list[nn.Module] = []
    inside: set[int] = set()  # modules already covered by a chosen unit
    if is_leaf_module(model):  # the root unit holds everything anyway
        return units

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in inside:
                continue
            in_list = isinstance(module, nn.ModuleList) and module is not model
            if (in_list or is_leaf_module(child)) and any(True for _ in child.parameters()):
                units.append(child)
                inside.update(id(m) for m in child.modules())
            elif not is_leaf_module(child):  # a leaf without parameters holds no unit either
                visit(child)

    if isinstance(model, nn.ModuleList):  # a bare list: its items are the blocks
        units = [m for m in model if any(True for _ in m.parameters())]
    else:
        visit(model)
    return units


def assign_units(model: nn.Module, unit_modules: list[nn.Module]) -> dict[int, int]:
    """``id(param) -> unit index``; index ``len(unit_modules)`` is the root unit.

    A parameter referenced from modules of more than one unit (as their own, or registered
    with ``register_external_parameter``) goes to the root unit.
    """
    root = len(unit_modules)
    unit_of_module: dict[int, int] = {}
    for index, unit in enumerate(unit_modules):
        for module in unit.modules():
            unit_of_module[id(module)] = index
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        unit = unit_of_module.get(id(module), root)
        for param in [*module.parameters(recurse=False), *external_parameters(module)]:
            owners.setdefault(id(param), set()).add(unit)
    return {pid: (next(iter(units)) if len(units) == 1 else root) for pid, units in owners.items()}
