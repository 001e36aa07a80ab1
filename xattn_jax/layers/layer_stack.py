"""Stacked layers: build N identical blocks as one module with a leading `layers` axis, apply them
with `nnx.scan` (compile time independent of depth) or unrolled, under a remat policy chosen by name.

    self.blocks = layer_stack.create_stack(lambda rngs: Block(..., rngs=rngs), num_layers, rngs)
    ...
    x = layer_stack.apply_stack(self.blocks, x, mask, scan=config.scan_layers, remat="dots")

A block is called as `block(x, *args, **kwargs) -> x` and must not change Python-side state. Its
parameters get the logical axis name "layers" prepended to their sharding names (replicated by the
default rules). Scanned and unrolled application compute the same function of the same parameters.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Name -> what jax.checkpoint may keep from the forward pass (None = no remat at all). The one list
# of remat policies: config validation reads it.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

LAYERS_AXIS = "layers"


def remat_policy(name: str):
  if name not in REMAT_POLICIES:
    raise ValueError(f"remat={name!r}: allowed are {sorted(REMAT_POLICIES)}")
  return REMAT_POLICIES[name]


def create_stack(make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs):
  """`num_layers` independently initialised blocks stored as one module, params [num_layers, ...]."""
  if isinstance(num_layers, (bool, np.bool_)) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
    raise ValueError(f"create_stack: num_layers must be an int >= 1, got {num_layers!r}")  # 2.0 failed in split_rngs

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
  def create(rngs):
    return make_block(rngs)

  return create(rngs)


def num_layers(stack) -> int:
  return jax.tree.leaves(nnx.state(stack))[0].shape[0]


def _split_static(args, kwargs):
  """(arrays, rebuild): the array leaves of (args, kwargs), and a function putting them back.

  Only arrays may cross into `nnx.scan` / `nnx.remat` (they become tracers there); Python values
  such as `deterministic=False`, a kernel name or a float scale must stay Python values, because
  blocks branch on them. So they are closed over instead of passed.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
  arrays = [leaf for leaf, array in zip(leaves, is_array) if array]
  static = [leaf for leaf, array in zip(leaves, is_array) if not array]

  def rebuild(arrays):
    arrays_left, static_left = iter(arrays), iter(static)
    return jax.tree.unflatten(treedef, [next(arrays_left) if array else next(static_left)
                                        for array in is_array])

  return arrays, rebuild


def _body(remat: str, rebuild):
  def call(block, x, arrays):
    args, kwargs = rebuild(arrays)
    return block(x, *args, **kwargs)

  policy = remat_policy(remat)
  if remat != "none":
    call = nnx.remat(call, policy=policy)
  return call


def apply_stack(stack, x, *args, scan: bool = True, remat: str = "none", **kwargs):
  """x -> block_{L-1}(... block_0(x, *args, **kwargs) ..., *args, **kwargs).

  `args` / `kwargs` (masks, positions, `deterministic`) are shared by every layer: their arrays are
  broadcast to each layer, everything else (bools, strings, numbers, None) reaches the blocks as
  the Python value it is. With `scan=True` the layers run as one `nnx.scan` (one traced block);
  otherwise as a Python loop over slices of the stack. Either way layer i draws its dropout masks
  from its own slice of the stacked RNG streams, so both give the same function.
  """
  arrays, rebuild = _split_static(args, kwargs)
  call = _body(remat, rebuild)
  if scan:
    @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry,
              transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
    def run_layers(block, carry, arrays):
      return call(block, carry, arrays)

    return run_layers(stack, x, arrays)
  graphdef, state = nnx.split(stack)
  before, after = [], []
  for i in range(num_layers(stack)):
    block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
    before.append(jax.tree.leaves(nnx.state(block, nnx.RngCount)))
    x = call(block, x, arrays)
    after.append(nnx.state(block, nnx.RngCount))
  # A layer that drew dropout masks advanced its copy's RNG counts: they are written back (as
  # nnx.scan does), so the next call draws new masks. Only then: a deterministic pass leaves the
  # stack untouched, and so still runs inside plain JAX transforms (jax.jacrev over a closure).
  drew = any(new is not old for layer, olds in zip(after, before) for new, old in zip(jax.tree.leaves(layer), olds))
  if drew:
    nnx.update(stack, jax.tree.map(lambda *layers: jnp.stack(layers), *after))
  return x
