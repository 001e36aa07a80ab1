"""Device mesh, logical-axis sharding rules and global batches.

Parameters carry logical axis names (`nnx.with_partitioning(init, ("embed", "mlp"))`, stored as the
Variable's `out_sharding` metadata); config.sharding_rules maps each name to mesh axes
(`embed -> fsdp`, `heads -> tensor`, ...). A dimension not divisible by its mesh axes' total size,
or whose mesh axis is already used by an earlier dimension of the same array, is replicated instead.
Names without a rule are replicated. Batches are sharded over the `batch` rule (data, fsdp).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xattn_jax.training import validation

MESH_AXES = validation.MESH_AXES


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all), -1 taking the remaining devices.

  Axis types are Auto (GSPMD propagation): with Explicit axes a matmul over a sharded contracting
  dimension raises. Devices stay in jax.devices() order, so each process owns a contiguous block
  of the data axis, which is what `global_batch` assumes.
  """
  devices = jax.devices() if devices is None else devices
  sizes = validation.mesh_shape(mesh_config, len(devices))
  device_grid = np.asarray(devices).reshape([sizes[a] for a in MESH_AXES])
  return Mesh(device_grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def _check_rules(function: str, rules, mesh) -> None:
  """A ValueError naming `function` where `rules` is no mapping {logical axis name: "mesh axes"} of MESH_AXES (a
  notebook's own rules: the launcher's are validated with the config), or names an axis `mesh` lacks."""
  if not hasattr(rules, "items"):
    raise ValueError(f"{function}: rules must map logical axis names to mesh axes, e.g. {{'mlp': 'tensor'}} "
                     f"(configs/common.py's DEFAULT_SHARDING_RULES), got {rules!r}")
  try:
    validation.check_sharding_rules(rules)
  except validation.ConfigError as error:
    raise ValueError(f"{function}: rules[{error.field.split('.', 1)[1]!r}]={error.value!r}: {error.allowed}") \
        from None
  for name in rules:
    if missing := [axis for axis in _rule_axes(rules, name) if axis not in mesh.shape]:
      raise ValueError(f"{function}: rules[{name!r}]={rules[name]!r} names mesh axis {missing[0]!r}, which the mesh "
                       f"(axes {tuple(mesh.shape)}) lacks; make_mesh gives {MESH_AXES}")


def _rule_axes(rules, name) -> tuple[str, ...]:
  if name is None or name not in rules:
    return ()
  return tuple(a.strip() for a in rules[name].split(",") if a.strip())


def logical_to_spec(names, shape, rules, mesh: Mesh, replicated: list | None = None) -> PartitionSpec:
  """PartitionSpec for an array of `shape` whose dimensions have logical `names`. Each dimension
  whose rule's mesh axes do not divide it is appended to `replicated` as (name, size, axes)."""
  if names is None:
    return PartitionSpec()
  if len(names) != len(shape):
    raise ValueError(f"logical_to_spec: names {tuple(names)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, size in zip(names, shape):
    axes = tuple(a for a in _rule_axes(rules, name) if mesh.shape[a] > 1 and a not in used)
    if axes and size % math.prod(mesh.shape[a] for a in axes) == 0:
      used.update(axes)
      spec.append(axes[0] if len(axes) == 1 else axes)
    else:
      if axes and replicated is not None:
        replicated.append((name, size, {a: mesh.shape[a] for a in axes}))
      spec.append(None)
  return PartitionSpec(*spec)


def state_shardings(abstract_state, mesh: Mesh, rules):
  """The same nnx.State (e.g. from nnx.eval_shape) with each Variable holding its NamedSharding.

  Dimensions left replicated because their mesh axes do not divide them (a d_model of 10 on
  tensor=4) are logged in one warning naming the parameters: a run sized so is correct, but holds
  and computes those arrays in full on every device of the axis. An optimizer's state (nnx.OptState: Adam's
  moments) is placed as its parameter is, and named in the warning only through that parameter."""
  _check_rules("state_shardings", rules, mesh)
  fallbacks = []

  def sharding(path, variable):
    names = variable.get_metadata().get("out_sharding")
    replicated = []
    spec = logical_to_spec(names, variable.shape, rules, mesh, replicated)
    if not isinstance(variable, nnx.OptState):  # an optimizer's moments lie as their parameter does: named once
      fallbacks.extend((jax.tree_util.keystr(path, simple=True, separator="."), list(variable.shape), *r)
                       for r in replicated)
    return variable.replace(NamedSharding(mesh, spec))

  shardings = jax.tree_util.tree_map_with_path(sharding, abstract_state,
                                               is_leaf=lambda x: isinstance(x, nnx.Variable))
  if fallbacks:
    shown = "; ".join(f"{path} {shape} ({name}={size} not divisible by {axes})"
                      for path, shape, name, size, axes in fallbacks[:5])
    logging.warning("sharding: %d parameter dimensions are replicated, not sharded, because their mesh axes do "
                    "not divide them: %s%s", len(fallbacks), shown, " ..." if len(fallbacks) > 5 else "")
  return shardings


def place_model(model: nnx.Module, mesh: Mesh, rules) -> nnx.Module:
  """The same model with every array on `mesh` as the rules place it (the trainer's placement, for a model
  built outside the launcher: a benchmark's, a notebook's).

  On one CPU, `jax.config.update("jax_num_cpu_devices", cores)` (or JAX_NUM_CPU_DEVICES) before JAX starts and
  a (data=1, tensor=cores) mesh run a decode tensor-parallel: each device computes its heads and its share of
  the MLP on its own core, where one device runs a decode's small per-head attention products on one core.
  """
  if not isinstance(model, nnx.Module):
    raise ValueError(f"place_model: model must be an nnx.Module, got {type(model).__name__}")
  _check_rules("place_model", rules, mesh)
  graphdef, state = nnx.split(model)
  shardings = state_shardings(state, mesh, rules)
  placements = jax.tree.map(lambda v: v.get_value(), shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, jax.device_put(state, placements))


def batch_sharding(mesh: Mesh, rules, stacked: bool = False) -> NamedSharding:
  """Sharding of a batch array: axis 0 over the `batch` rule's mesh axes, the rest replicated.
  stacked: the batch axis is axis 1, after a leading (replicated) axis of stacked steps."""
  _check_rules("batch_sharding", rules, mesh)
  axes = _rule_axes(rules, "batch")
  spec = (axes if axes else None,)
  return NamedSharding(mesh, PartitionSpec(*((None,) * stacked + spec)))


def logits_sharding(mesh: Mesh, rules) -> NamedSharding | None:
  """Where decoding's logits [rows, vocab] lie when the model is placed by the rules: rows over the `batch`
  rule's mesh axes, the vocabulary over the `vocab` rule's (the output projection's); None when no axis of
  the `vocab` rule splits anything (`decoding.search`'s logits_sharding: beam search and top-k sampling then
  rank each device's part of the vocabulary where it lies)."""
  _check_rules("logits_sharding", rules, mesh)
  vocab = tuple(a for a in _rule_axes(rules, "vocab") if mesh.shape[a] > 1)
  if not vocab:
    return None
  rows = tuple(a for a in _rule_axes(rules, "batch") if mesh.shape[a] > 1 and a not in vocab)
  return NamedSharding(mesh, PartitionSpec(rows or None, vocab))


def process_rows(sharding: NamedSharding, global_batch_size: int) -> tuple[int, int]:
  """[start, stop) of the global batch rows held by this process's devices (must be contiguous)."""
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  starts = sorted({idx[0].start or 0 for idx in index_map.values()})
  stops = sorted({global_batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()})
  start, stop = starts[0], stops[-1]
  covered = sum(b - a for a, b in zip(starts, stops))
  if covered != stop - start:
    raise ValueError(f"this process's batch rows are not contiguous: starts {starts}, stops {stops}")
  return start, stop


def rows_batch_size(rows: int, batch_size: int, sharding: NamedSharding | None) -> int:
  """The batch that `rows` rows are decoded in: `batch_size`, or for fewer rows the next power of two that holds
  them, as a multiple of the devices the rows split over (`sharding`'s row axes). Few compiled shapes across
  calls, and a search over 2 rows runs over 2, not over a padded eval batch of 256."""
  axes = sharding.spec[0] if sharding is not None and len(sharding.spec) else None
  split = int(np.prod([sharding.mesh.shape[axis] for axis in (axes if isinstance(axes, tuple) else (axes,))])
              ) if axes else 1
  size = 1 << max(rows - 1, 0).bit_length()
  return min(batch_size, -(-size // split) * split)


def rows_on_mesh(rows: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
  """The same global rows [n, ...] (every process holds all of them) as one array split over
  `sharding`'s row axes (n a multiple of their size, as a validated batch size is), each process
  giving its own part; with no sharding, as one replicated array."""
  if sharding is None:
    return jax.numpy.asarray(rows)
  start, stop = process_rows(sharding, len(rows))
  return jax.make_array_from_process_local_data(sharding, np.asarray(rows[start:stop]), rows.shape)


def rows_to_host(array: jax.Array) -> np.ndarray:
  """All rows of a (possibly multi-process) array as one numpy array on every process."""
  if not array.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(array)


def global_batch(local_batch: dict, mesh: Mesh, rules, global_batch_size: int, stacked: bool = False) -> dict:
  """Assembles each process's rows into global jax.Arrays sharded over (data, fsdp).
  stacked: each array is [steps, local rows, ...] (several steps' batches), rows on axis 1."""
  sharding = batch_sharding(mesh, rules, stacked)

  def make(array):
    array = np.asarray(array)
    shape = array.shape[:stacked] + (global_batch_size,) + array.shape[1 + stacked:]
    return jax.make_array_from_process_local_data(sharding, array, shape)

  return jax.tree.map(make, local_batch)
