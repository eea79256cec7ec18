"""tmrun: an interruption-resilient drop-in replacement for torchrun."""

from __future__ import annotations

__version__ = "0.1.0"
