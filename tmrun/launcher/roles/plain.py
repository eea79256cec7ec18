"""No standby to take over in place (``--standby 0``, or another rendezvous backend): the
agent only adds its instant failure detection and its report to the leader; the group
restarts as torchrun's would."""

from __future__ import annotations

from tmrun.launcher.roles.base import AgentRole


class PlainRole(AgentRole):
    pass
