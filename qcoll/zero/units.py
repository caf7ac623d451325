"""Choosing the units (submodules gathered together) and which parameters each one owns."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class Unit:
    """A submodule whose parameters are gathered before its forward and freed after."""

    path: str                  # module path inside the root ("" for the root itself)
    module: nn.Module
    owned: list = field(default_factory=list)     # [(qualified name, Parameter)] it owns
    used: list = field(default_factory=list)      # Parameters its forward reads (own or shared)
    groups: list = field(default_factory=list)    # FlatGroups it needs gathered (filled later)
    index: int = 0

    @property
    def label(self) -> str:
        return self.path or "<root>"


#: Containers whose ``forward`` is never called: hooks on them would never fire.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def is_container(m: nn.Module) -> bool:
    """A container without a ``forward`` of its own (a subclass that defines one is a unit)."""
    return isinstance(m, CONTAINERS) and type(m).forward is nn.Module.forward


_LISTS = (nn.ModuleList, nn.ModuleDict)


def _outermost(module: nn.Module, prefix: str, pick) -> list[tuple[str, nn.Module]]:
    """The outermost submodules (below ``module``) for which ``pick(module)`` is true."""
    chosen = []
    for name, child in module.named_children():
        path = prefix + name
        if pick(child):
            chosen.append((path, child))
        else:
            chosen += _outermost(child, path + ".", pick)
    return chosen


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _no_split_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes named in the model's ``_no_split_modules`` (Hugging Face's list of its
    repeated blocks, which Accelerate and FSDP auto-wrap use as their unit)."""
    names = getattr(model, "_no_split_modules", None)
    if not names or isinstance(names, str):
        return ()
    names = set(names)
    return tuple({type(m) for m in model.modules() if m is not model and type(m).__name__ in names})


def _container_entries(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The entries (with parameters) of every ``ModuleList``/``ModuleDict`` anywhere below
    ``module``, the outermost ones: a list inside a list is looked into."""
    chosen = []
    for name, child in module.named_children():
        path = prefix + name
        if isinstance(module, _LISTS) and not isinstance(child, _LISTS):
            if _has_params(child):
                chosen.append((path, child))
        else:
            chosen += _container_entries(child, path + ".")
    return chosen


def _direct_children(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Each direct child with parameters; a container child is replaced by its own children,
    recursively. A ``ParameterList``/``ParameterDict`` child is left to its parent's unit."""
    chosen = []
    for name, child in module.named_children():
        path = prefix + name
        if not _has_params(child) or isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            continue
        if is_container(child):
            chosen += _direct_children(child, path + ".")
        else:
            chosen.append((path, child))
    return chosen


def _default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: the classes of ``model._no_split_modules`` where the model has
    them, else the entries of ``ModuleList``s/``ModuleDict``s anywhere in the tree, else each
    direct child with parameters. The root unit takes what is left."""
    classes = _no_split_classes(model)
    if classes:
        chosen = [(p, m) for p, m in _outermost(model, "", lambda m: isinstance(m, classes)) if _has_params(m)]
        if chosen:
            return chosen
    chosen = _container_entries(model)
    return chosen or _direct_children(model)


def select_units(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    """``units``: None (the repeated blocks, see :func:`_default_units`), a list of
    submodules, or a list/tuple of module classes (every submodule of those types)."""
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    if units is None:
        chosen = _default_units(model)
    else:
        if isinstance(units, (nn.Module, type)):
            units = [units]
        if not isinstance(units, (list, tuple)) or not units:
            raise TypeError(f"units must be None or a non-empty list of submodules or module classes, got {units!r}")
        chosen = []
        classes = tuple(u for u in units if isinstance(u, type))
        for u in units:
            if isinstance(u, type):
                if not issubclass(u, nn.Module):
                    raise TypeError(f"units: {u!r} is not an nn.Module subclass")
            elif isinstance(u, nn.Module):
                if id(u) not in paths:
                    raise ValueError(f"units: {type(u).__name__} module is not a submodule of the model")
                chosen.append((paths[id(u)], u))
            else:
                raise TypeError(f"units must contain submodules or module classes, got {u!r}")
        if classes:
            chosen += [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
            if not any(isinstance(m, classes) for _, m in chosen):
                raise ValueError(f"units: the model has no submodule of type {[c.__name__ for c in classes]}")
        for name, m in chosen:
            if is_container(m):
                raise ValueError(f"units: the unit {name or '<root>'} is a {type(m).__name__}, whose forward is "
                                 "never called (its hooks would never gather it); name its elements instead")
            if not _has_params(m):
                raise ValueError(f"units: the unit {name or '<root>'} ({type(m).__name__}) has no parameters")
    seen, out = set(), []
    for name, m in chosen:
        if id(m) not in seen:
            seen.add(id(m))
            out.append((name, m))
    return out


def _owner(param_name: str, unit_paths: list[str]) -> str:
    """The innermost unit path containing the parameter (``""``: the root)."""
    best = ""
    for path in unit_paths:
        if path and (param_name == path or param_name.startswith(path + ".")) and len(path) > len(best):
            best = path
    return best


def build_units(model: nn.Module, units) -> list[Unit]:
    """Units in forward-registration order, with the parameters each owns and uses.

    A parameter belongs to the innermost unit containing its first name (as
    ``named_parameters`` reports it); a unit that reaches a parameter owned by
    another unit (tied weights) *uses* it and gathers that unit's group too.
    Parameters outside every unit form the root unit (present even when it owns none).
    """
    chosen = select_units(model, units)
    by_path = {path: Unit(path, m) for path, m in chosen}
    if "" not in by_path:
        by_path[""] = Unit("", model)
    paths = list(by_path)
    owner_of = {}
    for name, p in model.named_parameters():
        owner = _owner(name, paths)
        by_path[owner].owned.append((name, p))
        owner_of[id(p)] = owner
    for path, unit in by_path.items():
        prefix = path + "." if path else ""
        seen = set()
        for rel, p in unit.module.named_parameters(remove_duplicate=False):
            if _owner(prefix + rel, paths) != path or id(p) in seen:
                continue  # read by a nested unit, which gathers it itself
            seen.add(id(p))
            unit.used.append(p)
    ordered = [by_path[""]] + [by_path[p] for p, _ in chosen if p]
    result = [u for u in ordered if u.used or not u.path]  # the root always: its forward may read others' parameters
    for i, u in enumerate(result):
        u.index = i
    return result
