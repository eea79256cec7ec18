"""The worker's role: what a training process is, as one value with written, checked transitions.

A process of an in-place job is, at any step boundary, exactly one of:

========== ===========================================================================================
STANDBY    a standby worker: collectives served locally (the sandbox), shadow steps, then waiting
           for the controller's assignment (:mod:`tmrun.worker.standby`)
JOINING    a promoted standby: connected as its rank for the assigned generation, state not yet
           healed (receiving a migration's handover, or waiting for the donors)
ACTIVE     a rank that holds the committed state and trains (every rank of a job without a standby)
RECOVERING a rank whose group lost a member: waiting for the controller's plan, committing the
           repaired links, healing whoever is behind (:mod:`tmrun.worker.recovery`)
SWITCHING  a rank that stays through a planned migration: at the switch step it commits the links
           to the joiner and heals it (:mod:`tmrun.worker.migration`)
LEAVING    a migration's leaver: hands its state over and exits (no way back)
========== ===========================================================================================

The transitions (anything else raises :class:`IllegalTransition`)::

    STANDBY    -> JOINING                assigned a rank and warm: connected for its generation
    JOINING    -> ACTIVE                 healed (from the leaver's handover and/or the donors)
    JOINING    -> RECOVERING             a member was lost while joining: wait for the next plan
    ACTIVE     -> RECOVERING             a step lost a peer, or a failure elsewhere was planned
    ACTIVE     -> SWITCHING              this rank stays through a migration, at its switch step
    ACTIVE     -> LEAVING                this rank is a migration's leaver, at its switch step
    RECOVERING -> ACTIVE                 healed into the new generation
    RECOVERING -> LEAVING                a migration's leaver that lost a member before its switch
    RECOVERING -> JOINING                a joiner whose generation was superseded: it joins the newer one
    SWITCHING  -> ACTIVE                 the joiner is healed
    SWITCHING  -> RECOVERING             a member was lost during the switch: wait for the next plan

"Aborted" is not a role: it is a property of the current step (a collective of it lost a peer;
set from the backend's completer thread) that makes an ACTIVE rank go RECOVERING at the end of
the step. "Shadow" is not one either: a STANDBY runs shadow steps.
"""

from __future__ import annotations

from enum import Enum


class Role(Enum):
    STANDBY = "standby"
    JOINING = "joining"
    ACTIVE = "active"
    RECOVERING = "recovering"
    SWITCHING = "switching"
    LEAVING = "leaving"


TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.STANDBY: frozenset({Role.JOINING}),
    Role.JOINING: frozenset({Role.ACTIVE, Role.RECOVERING}),
    Role.ACTIVE: frozenset({Role.RECOVERING, Role.SWITCHING, Role.LEAVING}),
    Role.RECOVERING: frozenset({Role.ACTIVE, Role.LEAVING, Role.JOINING}),
    Role.SWITCHING: frozenset({Role.ACTIVE, Role.RECOVERING}),
    Role.LEAVING: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A part of the runtime asked for a role change the table does not allow (a bug)."""


class Lifecycle:
    """The current role; :meth:`to` changes it along :data:`TRANSITIONS` only. Changed by the
    training thread alone; other threads (the backend's failure handler, drill timers) only read
    it."""

    def __init__(self, role: Role) -> None:
        self._role = role
        self.history: list[Role] = [role]  # every role taken, in order (tests, post-mortems)

    @property
    def role(self) -> Role:
        return self._role

    def is_(self, *roles: Role) -> bool:
        return self._role in roles

    def to(self, role: Role) -> None:
        if role not in TRANSITIONS[self._role]:
            raise IllegalTransition(f"worker role {self._role.name} -> {role.name} is not a transition "
                                    f"(allowed: {', '.join(sorted(r.name for r in TRANSITIONS[self._role])) or 'none'})")
        self._role = role
        self.history.append(role)

    def __repr__(self) -> str:
        return f"Lifecycle({self._role.name})"
