"""TEST-ONLY CPU shim for torchtitan 0.3.0. torchtitan assumes an accelerator; on a CPU-only
machine three things are changed, in torchtitan's module attributes only (nothing on disk):

* the device: ``torchtitan.tools.utils.device_type`` is ``"cpu"`` (and the copies other modules
  imported), its ``device_module`` a stand-in for ``torch.cpu`` whose ``current_device()`` is an
  int (``barrier(device_ids=[...])`` refuses "cpu"), with no-op memory statistics;
* attention: the model configs' FlexAttention (no backward on CPU) becomes plain SDPA
  (:func:`sdpa_everywhere`), as torchtitan's own smoke tests do;
* reductions: under gloo (a plain torchtitan run, no tmrun) FSDP2 reduce-scatters with
  ``PREMUL_SUM``, which gloo refuses; :func:`install` makes torch use SUM and divide itself, as
  it already does for some devices. Under tmrun (also under torchrun with the integration:
  the "tmrun" backend serves PREMUL_SUM) this is not needed and not applied.

Call :func:`install` before the trainer is built (importing :mod:`tests.titan.config` does)."""

from __future__ import annotations

import os
import types
from typing import Any

import torch


class _CpuDeviceModule(types.SimpleNamespace):
    """What torchtitan calls on its ``device_module``, for the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(_device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(_device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(_device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), name="cpu")

    @staticmethod
    def memory_stats(_device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(_device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def synchronize(_device: Any = None) -> None:
        return None


_INSTALLED = False


def install() -> None:
    """Point torchtitan at the CPU (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as utils

    module = _CpuDeviceModule()
    for target in (utils, metrics, dist_utils, parallel_dims, token_dispatcher):
        if hasattr(target, "device_type"):
            target.device_type = "cpu"
        if hasattr(target, "device_module"):
            target.device_module = module
    _sum_reductions_for_gloo()
    _INSTALLED = True


def _sum_reductions_for_gloo() -> None:
    """FSDP2's gradient reduction without PREMUL_SUM where the group is gloo (see the docstring)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    except ImportError:
        return
    original = getattr(collectives, "_get_gradient_divide_factors", None)
    if original is None:
        return

    def divide_factors(reduce_scatter_group: Any, all_reduce_group: Any, reduce_dtype: torch.dtype,
                       device_type: str = "", factor: float | None = None, force_sum: bool = False) -> Any:
        import torch.distributed as dist

        groups = [g for g in (reduce_scatter_group, all_reduce_group) if g is not None]
        if any(dist.get_backend(g) == "gloo" for g in groups):
            force_sum = True
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, force_sum)

    collectives._get_gradient_divide_factors = divide_factors


def sdpa_everywhere(model_config: Any) -> None:
    """Replace every FlexAttention config in ``model_config`` by plain SDPA (in place)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _fqn, _config, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if parent is None:
            raise ValueError("the model config itself is an attention config")
        new = ScaledDotProductAttention.Config()
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
