"""Unit checks of tmrun.integrations.torchtitan and the test-only CPU shim, without processes
(skipped where torchtitan is not installed): the ``--module``/``--config`` lookup through
torchtitan's own ConfigManager, the loader position's restore flag, the shim's SDPA swap."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

# e2e: each test imports torchtitan (about 5 s on 2 cores), too slow for the unit subset
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[torchtitan]')"),
              pytest.mark.e2e]


def test_torchtitans_config_manager_builds_the_integrations_trainer_from_any_registry_config() -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from tmrun.integrations.torchtitan import TmrunTrainer

    config = ConfigManager().parse_args(["--module", "tmrun.integrations.torchtitan", "--config", "llama3_debugmodel",
                                         "--training.steps", "3", "--debug.seed", "7"])
    assert isinstance(config, TmrunTrainer.Config) and type(config)._owner is TmrunTrainer
    assert config.training.steps == 3 and config.debug.seed == 7
    own = llama3_debugmodel()
    assert config.training.seq_len == own.training.seq_len and config.model_spec.name == own.model_spec.name


def test_an_unknown_config_name_is_not_found() -> None:
    import tmrun.integrations.torchtitan as integration

    with pytest.raises(AttributeError):
        integration.no_such_config  # noqa: B018
    with pytest.raises(AttributeError):
        integration.NotAConfig  # noqa: B018


def test_a_restored_loader_position_restarts_the_batch_iterator() -> None:
    from tmrun.integrations.torchtitan import _LoaderPosition

    class Loader:
        def __init__(self) -> None:
            self.state: dict[str, Any] = {"dp_rank_0": b"0"}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.state)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = dict(state)

    loader = Loader()
    position = _LoaderPosition(loader)
    assert position.restored  # no iterator yet
    position.restored = False
    saved = position.state_dict()
    loader.state = {"dp_rank_0": b"1"}
    position.load_state_dict(saved)
    assert loader.state == {"dp_rank_0": b"0"} and position.restored


def test_the_cpu_shim_swaps_every_flex_attention_for_sdpa() -> None:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from tests.titan.cpu_shim import sdpa_everywhere

    model = llama3_debugmodel().model_spec.model
    assert list(model.traverse(FlexAttention.Config))
    sdpa_everywhere(model)
    assert not list(model.traverse(FlexAttention.Config))
    assert len(list(model.traverse(ScaledDotProductAttention.Config))) == 6  # the debug model's layers
