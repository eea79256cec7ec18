"""The "tmrun" rendezvous backend for torch.distributed.elastic."""

from __future__ import annotations

from tmrun.rendezvous.registration import register_tmrun_backend

__all__ = ["register_tmrun_backend"]
