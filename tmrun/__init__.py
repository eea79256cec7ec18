"""tmrun: an interruption-resilient drop-in replacement for torchrun.

``tm = tmrun.init()`` in a training script gives in-place replacement (see docs/user-guide.md).
"""

from __future__ import annotations

__version__ = "0.1.0"


def init() -> "Runtime":
    """Start this worker's runtime (see :mod:`tmrun.worker.runtime`)."""
    from tmrun.worker.runtime import init as _init

    return _init()


if False:  # pragma: no cover - typing only
    from tmrun.worker.runtime import Runtime
