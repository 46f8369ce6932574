"""Where a model holds each of its tensors, so that an export can put inputs in their place.

An inference model keeps most of its weights outside parameters (`models.weights`' LinearWeight objects, the
experts' stacks, the rotary table), where `torch.export` would bake them into the graph as constants. A slot is a
path from the model to one place holding a tensor: a submodule, a parameter or buffer, an attribute of one of our
objects, an item of a list, tuple or dict. The same tensor held in several places (a fused weight and its parts,
tied embeddings) is one tensor with several slots, all swapped together.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

Step = list  # [kind, key]: "m" submodule, "p" parameter, "b" buffer, "a" attribute, "i" item of a container
OURS = ("models.", "moe.")  # plain objects of these packages are looked into; any other object is left alone


def _children(obj) -> list[tuple[Step, object]]:
    if isinstance(obj, nn.Module):
        out = [(["p", k], v) for k, v in obj._parameters.items()] + [(["b", k], v) for k, v in obj._buffers.items()]
        out += [(["m", k], v) for k, v in obj._modules.items()]
        return out + [(["a", k], v) for k, v in vars(obj).items() if not k.startswith("_") and k != "training"]
    if isinstance(obj, (list, tuple)):
        return [(["i", i], v) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(["i", k], v) for k, v in obj.items() if isinstance(k, (str, int))]
    if type(obj).__module__.startswith(OURS) and hasattr(obj, "__dict__"):
        return [(["a", k], v) for k, v in vars(obj).items()]
    return []


def _get(obj, step: Step):
    kind, key = step
    if kind == "p":
        return obj._parameters[key]
    if kind == "b":
        return obj._buffers[key]
    if kind == "m":
        return obj._modules[key]
    return obj[key] if kind == "i" else vars(obj)[key]


def _put(obj, step: Step, value) -> object:
    """`obj` with `value` at `step`: the same object changed in place, or a new tuple."""
    kind, key = step
    if kind == "i" and isinstance(obj, tuple):
        return obj[:key] + (value,) + obj[key + 1:]
    if kind in "pbm":
        {"p": obj._parameters, "b": obj._buffers, "m": obj._modules}[kind][key] = value
    elif kind == "i":
        obj[key] = value
    else:
        vars(obj)[key] = value
    return obj


def _set(root, path: list[Step], value) -> None:
    chain = [root]
    for step in path[:-1]:
        chain.append(_get(chain[-1], step))
    for obj, step in zip(reversed(chain), reversed(path), strict=True):
        new = _put(obj, step, value)
        if new is obj:
            return
        value = new  # a tuple was rebuilt: put it into its parent


class TensorSlots:
    """The tensors of `root` that a step reads, in a fixed order, each with every path that holds it."""

    def __init__(self, root: nn.Module, paths: list[list[list[Step]]]) -> None:
        self.root, self.paths = root, paths

    @classmethod
    def of(cls, root: nn.Module, wanted: set[int]) -> TensorSlots:
        """The tensors whose ids are in `wanted`, in the order a walk of the model meets them."""
        found: dict[int, list[list[Step]]] = {}
        seen: set[int] = set()

        def walk(obj, path: list[Step]) -> None:
            if isinstance(obj, torch.Tensor):
                if id(obj) in wanted:
                    found.setdefault(id(obj), []).append(path)
                return
            if id(obj) in seen:
                return
            seen.add(id(obj))
            for step, child in _children(obj):
                walk(child, [*path, step])

        walk(root, [])  # an object met twice is walked once: swapping its tensors once serves all its holders
        return cls(root, list(found.values()))

    @classmethod
    def at(cls, root: nn.Module, paths: list[list[list[Step]]]) -> TensorSlots:
        slots = cls(root, paths)
        slots.read()  # a path this model does not have fails here, before any call
        return slots

    def read(self) -> list[torch.Tensor]:
        out = []
        for paths in self.paths:
            obj = self.root
            for step in paths[0]:
                obj = _get(obj, step)
            if not isinstance(obj, torch.Tensor):
                raise KeyError(f"no tensor at {paths[0]}")
            out.append(obj)
        return out

    @contextlib.contextmanager
    def swapped(self, tensors: list[torch.Tensor]):
        """Every slot holds the given tensor instead of its own until the block ends."""
        own = self.read()
        try:
            for paths, t in zip(self.paths, tensors, strict=True):
                for path in paths:
                    _set(self.root, path, t)
            yield
        finally:
            for paths, t in zip(self.paths, own, strict=True):
                for path in paths:
                    _set(self.root, path, t)
