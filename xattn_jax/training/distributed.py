"""Multi-host start: `jax.distributed.initialize` from flags, or automatically on a cluster.

Call `initialize` before ANY JAX backend call (even `jax.devices()`): afterwards it fails.
"""
from __future__ import annotations

import os

import jax


def cluster_detected() -> bool:
  """True where JAX can find the coordinator by itself: a multi-task SLURM job or a TPU pod slice."""
  slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
  tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return ("SLURM_JOB_ID" in os.environ and slurm_tasks > 1) or "," in tpu_hosts


def initialize(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0) -> bool:
  """Starts multi-process JAX; returns whether it did.

  Explicit flags win (all processes get the same coordinator address and process count, each its
  own id); without them, JAX's own cluster detection runs where `cluster_detected()`.
  """
  if coordinator_address:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True
  if num_processes > 1:
    raise ValueError(f"num_processes={num_processes} needs --coordinator_address=HOST:PORT")
  if cluster_detected():
    jax.distributed.initialize()
    return True
  return False
