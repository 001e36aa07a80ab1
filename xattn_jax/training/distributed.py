"""Process start: the CPU device count, and multi-host `jax.distributed.initialize` from flags or on a cluster.

Call `set_cpu_devices` and `initialize` before ANY JAX backend call (even `jax.devices()`): JAX fixes its devices
and processes when its backend starts, so they cannot take effect afterwards (launch.py calls them first).
"""
from __future__ import annotations

import json
import os
import sys

import jax
from absl import logging

from xattn_jax.ops import attention as attention_ops
from xattn_jax.training import validation


def environment_cpu_devices() -> str | None:
  """The environment setting that already fixes the CPU device count (JAX_NUM_CPU_DEVICES, or XLA_FLAGS'
  --xla_force_host_platform_device_count), or None."""
  if "JAX_NUM_CPU_DEVICES" in os.environ:
    return f"JAX_NUM_CPU_DEVICES={os.environ['JAX_NUM_CPU_DEVICES']}"
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if flag.startswith("--xla_force_host_platform_device_count")]
  return f"XLA_FLAGS {flags[-1]}" if flags else None


def cpu_device_count(config, cores: int) -> int:
  """The CPU devices `config.cpu_devices` asks for on `cores` cores: N > 0 itself; 0 the most, at most one a
  core, that the mesh and the batch sizes divide into (validation.check_mesh), at least 1."""
  if cores < 1:
    raise ValueError(f"cores must be >= 1, got {cores}")
  if config.get("cpu_devices", 1):  # a run's config.py written before the field existed has none
    return config.cpu_devices
  for count in range(cores, 1, -1):
    try:
      validation.check_mesh(config, count)
    except validation.ConfigError:
      continue
    return count
  return 1


def set_cpu_devices(config, multi_process: bool) -> int | None:
  """Gives this process `cpu_device_count(config, its cores)` CPU devices before its backend starts; returns
  that count, or None where it leaves JAX's default: config.cpu_devices = 1, a multi-process run (each process's
  devices are its environment's), or an environment that already sets the count (it wins, said in the log)."""
  count = cpu_device_count(config, attention_ops.usable_cores())
  if count == 1:
    return None
  if multi_process:
    logging.info("cpu_devices=%d not applied: a multi-process run takes its devices from its environment",
                 config.cpu_devices)
    return None
  if (setting := environment_cpu_devices()) is not None:
    logging.info("cpu_devices=%d not applied: the environment sets the CPU device count (%s)",
                 config.cpu_devices, setting)
    return None
  jax.config.update("jax_num_cpu_devices", count)
  return count


def cluster_detected() -> bool:
  """True where JAX can find the coordinator by itself: a multi-task SLURM job or a TPU pod slice."""
  slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
  tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return ("SLURM_JOB_ID" in os.environ and slurm_tasks > 1) or "," in tpu_hosts


def check_flags(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0) -> None:
  """Raises ValueError (one line naming the flag) for multi-host flags that cannot work together."""
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes}: must be >= 1")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id}: must be in [0, --num_processes={num_processes})")
  if not coordinator_address:
    if num_processes > 1:
      raise ValueError(f"--num_processes={num_processes} needs --coordinator_address=HOST:PORT "
                       "(the address of process 0, the same on every process)")
    return
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"--coordinator_address={coordinator_address!r}: must be HOST:PORT with a port in "
                     "1..65535, e.g. 10.0.0.1:1234")


def initialize(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0,
               timeout_seconds: int = 300) -> bool:
  """Starts multi-process JAX; returns whether it did.

  Explicit flags win (all processes get the same coordinator address and process count, each its
  own id); without them, JAX's own cluster detection runs where `cluster_detected()`. A process
  whose peers have not all connected after `timeout_seconds` is aborted by JAX's coordination
  client (a C++ fatal error, not an exception), so the wait is announced on stderr first.
  """
  check_flags(coordinator_address, num_processes, process_id)
  if coordinator_address:
    print(f"process {process_id} of {num_processes}: waiting up to {timeout_seconds} s for all "
          f"{num_processes} processes to connect to {coordinator_address}", file=sys.stderr, flush=True)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_seconds)
    if jax.process_count() != num_processes:
      raise ValueError(f"--num_processes={num_processes}, but the coordinator at {coordinator_address} "
                       f"started {jax.process_count()} processes: give every process the same value")
    return True
  if cluster_detected():
    jax.distributed.initialize(initialization_timeout=timeout_seconds)
    return True
  return False


def check_same_run(config, workdir: str, mode: str, timeout_seconds: int = 300) -> None:
  """Raises ValueError (one line naming the first field) where the processes of a multi-process run were given
  other configs, workdirs or modes: each would compile its own program, and they met in collectives that never
  matched (one given --config.total_steps=12 beside 8 waited for its peer until it was killed; two workdirs left
  each process waiting for the other's half of the first checkpoint). Every process publishes its
  fields in the coordination service, reads every other's and reaches the same verdict, so all stop together."""
  from jax._src import distributed as jax_distributed  # the coordination service's key-value store
  from xattn_jax.training import workdir as workdir_lib
  client, count = jax_distributed.global_state.client, jax.process_count()
  if count == 1 or client is None:
    return
  fields = {"--workdir": os.path.abspath(workdir), "--mode": mode, **{f"--config.{k}": v
                               for k, v in workdir_lib.flat(json.loads(config.to_json_best_effort())).items()}}
  client.key_value_set(f"xattn_jax/run_fields/{jax.process_index()}", json.dumps(fields, sort_keys=True))
  timeout_ms = timeout_seconds * 1000
  given = [json.loads(client.blocking_key_value_get(f"xattn_jax/run_fields/{i}", timeout_ms)) for i in range(count)]
  client.wait_at_barrier("xattn_jax/run_fields_read", timeout_ms)  # nobody leaves while a peer still reads
  for i, other in enumerate(given[1:], 1):
    for field in sorted(set(given[0]) | set(other)):
      if given[0].get(field) != other.get(field):
        raise ValueError(f"process {i} was given {field}={other.get(field)!r}, process 0 "
                         f"{field}={given[0].get(field)!r}: every process of a run needs the same --config, "
                         "--config.* overrides, --workdir and --mode")
