"""Writes the torchrun-related environment of this worker as JSON to $DUMP_DIR/env-<RANK>.json."""

import json
import os

PREFIXES = ("RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "OMP_NUM_THREADS", "TORCH_NCCL")
env = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
with open(os.path.join(os.environ["DUMP_DIR"], f"env-{os.environ['RANK']}.json"), "w") as out:
    json.dump(env, out, sort_keys=True)
