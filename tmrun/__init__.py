"""tmrun: an interruption-resilient drop-in replacement for torchrun.

``import tmrun`` registers the torch.distributed backend "tmrun"; ``tm = tmrun.init()`` in a
training script starts the worker runtime (in-place replacement; see docs/user-guide.md).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tmrun.worker.runtime import Runtime

__version__ = "0.1.0"


def _register_backend() -> None:
    partial = sys.modules.get("tmrun.comm.backend")
    if partial is not None and not hasattr(partial, "register"):
        return  # torch was imported by tmrun.comm.backend itself, which registers once it is loaded
    from tmrun.comm.backend import register

    register()  # torch.distributed backend "tmrun"


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Registers the backend right after ``import torch`` completes, for a script that imports
    tmrun first: ``import tmrun`` itself does not load torch (``tmrun-ctl`` starts without it).
    It stays in place until torch actually ran (a mere ``importlib.util.find_spec("torch")``, as
    libraries do to test for torch, executes nothing)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_backend()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torch" in sys.modules:
    _register_backend()
else:
    sys.meta_path.insert(0, _AfterTorch())


def init() -> Runtime:
    """Start (or return) this worker's runtime (see :mod:`tmrun.worker.runtime`)."""
    from tmrun.worker.runtime import init as _init

    return _init()
