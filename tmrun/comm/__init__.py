"""tmrun.comm: the data plane (native communicator helpers; ProcessGroup backend to come)."""
