"""The contract between tmrun's processes: store keys, messages, membership, launch environment.

Owns every name that crosses a process boundary, and nothing else: :mod:`keys` (every store key
and key prefix), :mod:`messages` (every JSON message as a validated dataclass, one-line
``ProtocolMessageError`` on bad input), :mod:`membership` (the leader's published view of the
job) and :mod:`environment` (what an agent tells the processes it starts, as one type); how
every process reaches the job's store (:mod:`stores`; :mod:`etcd` for a store on etcd); how
long a process started by an agent may outlive it (:mod:`orphan_guard`). It
imports nothing else from tmrun, so every other package may import it.
"""
