"""RNG states a step depends on: torch (CPU and CUDA), Python's ``random``, NumPy when present."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only when the script uses it; never imported here
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def restore(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])


def _same_state(name: str, x: Any, y: Any) -> bool:
    if name == "torch":
        return torch.equal(x, y)
    if name == "cuda":
        return len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))
    if name == "numpy":
        return x[0] == y[0] and bytes(memoryview(x[1])) == bytes(memoryview(y[1])) and x[2:] == y[2:]
    return x == y


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two captures hold the same states (cheap: a few kB compared)."""
    return a.keys() == b.keys() and all(_same_state(name, a[name], b[name]) for name in a)


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The generators whose states differ between capture ``a`` and the later ``b`` (one that
    only ``b`` has: ``"numpy (imported since)"``)."""
    names = [f"{name} (imported since)" for name in b.keys() - a.keys()]
    names += [name for name in a.keys() & b.keys() if not _same_state(name, a[name], b[name])]
    return sorted(names)
