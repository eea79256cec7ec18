"""What an agent does beyond torch's elastic agent, by the job's shape: one role per agent.

The agent (:mod:`tmrun.launcher.agent`) runs torch's loop and calls a few hooks; its role,
chosen once at construction by :func:`choose_role`, answers them:

* :class:`~tmrun.launcher.roles.plain.PlainRole`: no standby (or a plain torchrun script):
  failures are seen at once and reported, the group restarts as torchrun's would;
* :class:`~tmrun.launcher.roles.local.LocalStandbyRole`: one node with standby worker processes:
  a failed rank is replaced in place by a warm standby process;
* :class:`~tmrun.launcher.roles.nodes.NodeRole`: several nodes with standby nodes: an active node
  watches and fences its workers (the leader decides), a standby node keeps one warm standby
  worker per local rank and adopts them when it is given a failed node's ranks.

The replacement decisions themselves live in :mod:`tmrun.control.replacement`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tmrun.launcher.roles.base import AgentRole

if TYPE_CHECKING:
    from tmrun.launcher.agent import AgentSettings, TmrunAgent


def choose_role(agent: TmrunAgent, settings: AgentSettings) -> AgentRole:
    from tmrun.launcher.roles.local import LocalStandbyRole
    from tmrun.launcher.roles.nodes import NodeRole
    from tmrun.launcher.roles.plain import PlainRole

    handler = agent.tmrun_handler
    if settings.standby_workers and handler is not None:
        return LocalStandbyRole(agent, settings, handler)
    if settings.standby_nodes and handler is not None:
        return NodeRole(agent, settings, handler)
    return PlainRole(agent, settings, handler)


__all__ = ["AgentRole", "choose_role"]
