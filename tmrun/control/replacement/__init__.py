"""In-place replacement: one core, two policies (one per topology).

* :mod:`core`: publishing a generation, tracking its recovery, migration requests, workers'
  reports, ready standbys, this node's processes and fencing them;
* :mod:`processes`: one node, a member is a worker process (the agent's controller);
* :mod:`nodes`: several nodes, a member is a node (the leader's decisions, and each active
  agent's watch over its own workers).
"""
