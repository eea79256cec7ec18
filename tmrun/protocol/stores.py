"""Opening the job's store from a process's launch environment: the agents' TCPStore, or etcd."""

from __future__ import annotations

import json
from datetime import timedelta

import torch.distributed as dist

from tmrun.protocol.environment import ENV_STORE_OPTIONS, LaunchEnv, LaunchEnvError


def open_job_store(env: LaunchEnv, timeout: float = 60.0) -> dist.Store:
    """The unprefixed store the agent named in ``env`` (in-place modes only)."""
    if env.store_etcd:
        from tmrun.protocol.etcd import EtcdConfig, EtcdConfigError, EtcdStore

        try:
            options = json.loads(env.store_options or "{}")
            if not isinstance(options, dict):
                raise ValueError
            config = EtcdConfig.parse(env.store_etcd, options)
        except (ValueError, EtcdConfigError) as exc:
            raise LaunchEnvError(f"{ENV_STORE_OPTIONS} or the etcd endpoints are malformed: {exc}") from None
        return EtcdStore.for_job(config, env.run_id, timeout=timeout, connect_timeout=timeout)
    return dist.TCPStore(env.store_host, env.store_port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)
