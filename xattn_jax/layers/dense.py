"""A dense layer whose matmul is always [rows, in] x [in, out].

`nnx.Linear` contracts the last axis of an input of any rank. For a `[batch, length, in]` input the
backward pass then computes the kernel gradient by contracting two axes (batch and length) at once,
and XLA:CPU lays that out by transposing the `[batch, length, out]` cotangent first: a full copy of
the activation per layer (16 MB for an MLP's hidden layer at batch 32 x length 64 x 2048), about a
sixth of an MLP block's forward + backward time. Flattening the leading axes first makes every
matmul, forward and backward, a plain 2D one with no transposed copy. Same parameters (`kernel`,
`bias`) and same initialisers as `nnx.Linear`, so checkpoints and weight copies carry over.

`loop_kernels` prepares a decoding loop's layers: their kernels stored `[out, in]` for few-row products.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def flat_matmul(x: jax.Array, fn) -> jax.Array:
  """fn applied to x reshaped to [rows, features], the result reshaped back: [..., f] -> [..., g]."""
  leading = x.shape[:-1]
  y = fn(x.reshape(-1, x.shape[-1]))
  return y.reshape(*leading, y.shape[-1])


def embed_ids(table: nnx.Embed, ids: jax.Array) -> jax.Array:
  """table(ids) [..., features], NaN for every id outside [0, num_embeddings): the lookup fills ids past the
  table with NaN but wraps negative ones to its end, so -1 read the last row without a word."""
  return jnp.where((ids < 0)[..., None], jnp.nan, table(ids))


class Dense(nnx.Linear):
  """`nnx.Linear` over the last axis of `[..., in_features]`, as one 2D matmul. -> `[..., out_features]`."""

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if inputs.ndim < 1 or inputs.shape[-1] != self.in_features:
      raise ValueError(f"Dense: inputs must be [..., {self.in_features}], got inputs{list(inputs.shape)}")
    return flat_matmul(inputs, super().__call__)


def _is_kernel(path, leaf) -> bool:
  """A matmul kernel of a split module: a 2-D leaf at `...['kernel']` (or its Variable's `.value`)."""
  names = [getattr(key, "key", getattr(key, "name", None)) for key in path[-2:]]
  return getattr(leaf, "ndim", 0) == 2 and "kernel" in names


def loop_kernels(modules: Sequence[nnx.Module], *, transpose: bool = True) -> Callable[[jax.Array], list[nnx.Module]]:
  """For a decoding loop over `modules`: every 2-D `kernel` ([in, out]) stored transposed, [out, in], once,
  now; returns `at(anchor)`, which gives the modules back inside the loop body, reading the stored rows.

  A decoding step multiplies a few rows (batch x beams) by every weight matrix, each streamed from memory.
  Stored [out, in] (each output's weights contiguous, as torch's and XNNPACK's fully connected layers keep
  them), a kernel streams into XLA:CPU's few-row matmuls faster on the AVX2 processor measured (bench_lm.py
  and bench_translator.py time both layouts). Inside the body each kernel is the stored one transposed
  back, a transpose XLA folds into the matmul's contraction. `anchor` is any value the step computes from
  its inputs (its tokens): an optimization barrier ties the kernels to it, so XLA's loop-invariant code
  motion cannot hoist those transposes out of the loop, where they would cancel the stored ones.
  `transpose=False` keeps the kernels as they are ([in, out]; `at` returns the modules themselves), for
  comparison.
  """
  modules = list(modules)
  if not all(isinstance(module, nnx.Module) for module in modules):
    raise ValueError(f"loop_kernels: modules must be nnx.Modules, got "
                     f"{[type(module).__name__ for module in modules]}")
  if not transpose:
    return lambda anchor: modules
  pieces = []
  for module in modules:
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    kernels = [i for i, (path, leaf) in enumerate(leaves) if _is_kernel(path, leaf)]
    stored = [leaf for _, leaf in leaves]
    for i in kernels:
      stored[i] = stored[i].T
    pieces.append((graphdef, treedef, kernels, stored))

  def at(anchor: jax.Array) -> list[nnx.Module]:
    held, _ = jax.lax.optimization_barrier(([[stored[i] for i in kernels] for _, _, kernels, stored in pieces],
                                            anchor))
    rebuilt = []
    for (graphdef, treedef, kernels, stored), transposed in zip(pieces, held):
      leaves = list(stored)
      for i, kernel in zip(kernels, transposed):
        leaves[i] = kernel.T
      rebuilt.append(nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)))
    return rebuilt
  return at
