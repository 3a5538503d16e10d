"""Old import paths of the modules that left ``fpscale.models`` (the layer types went to
fpscale.layers, the kernels to fpscale.ops): ``import fpscale.models.fpsa`` still works, with a
FutureWarning naming the new path, so user code, notebooks and HF exports written before the move
keep running. ``fpscale.models.common`` was split three ways; its alias finds each name where it went.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

LAYERS = ("attn", "fpsa", "fpsa_lh", "fpmamba", "fpmamba2", "epsilon", "looped", "mixers", "halting", "hqsa",
          "looping", "fixed_point", "checkpointing", "deep_supervision", "registry")
OPS = ("scan", "scan_triton", "scan_kernels", "ssd", "kernels", "kernel_plan", "chunked_loss")
MOVED: dict[str, tuple[str, ...]] = {
    **{name: (f"fpscale.layers.{name}",) for name in LAYERS},
    **{name: (f"fpscale.ops.{name}",) for name in OPS},
    "common": ("fpscale.layers.common", "fpscale.ops.attention", "fpscale.models.heads"),
}


def _split_module(old: str, targets: tuple[str, ...]) -> types.ModuleType:
    """A module whose names are looked up in each of ``targets`` in turn."""
    modules = [importlib.import_module(t) for t in targets]
    alias = types.ModuleType(old, f"moved: {', '.join(targets)}")

    def __getattr__(name: str):
        for m in modules:
            if hasattr(m, name):
                return getattr(m, name)
        raise AttributeError(f"{old} moved to {', '.join(targets)}; none of them has {name!r}")

    alias.__getattr__ = __getattr__          # type: ignore[method-assign]
    return alias


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, targets: tuple[str, ...]):
        self.targets = targets

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {' + '.join(self.targets)}: import it from there "
                      f"(the old path is kept for code written before the move)", FutureWarning, stacklevel=3)
        if len(self.targets) == 1:
            return importlib.import_module(self.targets[0])
        return _split_module(spec.name, self.targets)

    def exec_module(self, module):
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != "fpscale.models" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(MOVED[name]))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
