"""The data plane: native TCP communicator helpers (native.py), the NCCL transport (nccl.py)
and the torch.distributed backend "tmrun" (backend.py)."""
