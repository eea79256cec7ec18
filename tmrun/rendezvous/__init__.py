"""The rendezvous adapter: torch's ``RendezvousHandler`` over the job's store.

Owns: opening (or hosting) the store (:mod:`endpoint`), registering this agent as a node,
reading the leader's membership and turning it into torch's ``RendezvousInfo`` per epoch
(:mod:`handler`), and the agents' liveness connections to the leader (:mod:`liveness`). It
decides nothing: the leader (``tmrun.control``) does, and is handed in by
``tmrun.control.rendezvous_backend``. Imports only ``tmrun.protocol`` and ``tmrun.console``.
"""
