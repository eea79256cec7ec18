"""torch.distributed integration and transports of tmrun (see nccl.py for the NCCL transport)."""
