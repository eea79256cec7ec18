"""A torchrun worker that joins the process group and sleeps (for status/standby tests)."""

import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0)
dist.barrier()
dist.destroy_process_group()
