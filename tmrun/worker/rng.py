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


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two captures hold the same states (cheap: a few kB compared)."""
    if a.keys() != b.keys() or not torch.equal(a["torch"], b["torch"]) or a["python"] != b["python"]:
        return False
    if "cuda" in a and not all(torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"])):
        return False
    if "numpy" in a:
        na, nb = a["numpy"], b["numpy"]
        return na[0] == nb[0] and bytes(memoryview(na[1])) == bytes(memoryview(nb[1])) and na[2:] == nb[2:]
    return True
