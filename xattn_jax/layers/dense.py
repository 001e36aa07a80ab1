"""A dense layer whose matmul is always [rows, in] x [in, out].

`nnx.Linear` contracts the last axis of an input of any rank. For a `[batch, length, in]` input the
backward pass then computes the kernel gradient by contracting two axes (batch and length) at once,
and XLA:CPU lays that out by transposing the `[batch, length, out]` cotangent first: a full copy of
the activation per layer (16 MB for an MLP's hidden layer at batch 32 x length 64 x 2048), about a
sixth of an MLP block's forward + backward time. Flattening the leading axes first makes every
matmul, forward and backward, a plain 2D one with no transposed copy. Same parameters (`kernel`,
`bias`) and same initialisers as `nnx.Linear`, so checkpoints and weight copies carry over.
"""
from __future__ import annotations

import jax
from flax import nnx


def flat_matmul(x: jax.Array, fn) -> jax.Array:
  """fn applied to x reshaped to [rows, features], the result reshaped back: [..., f] -> [..., g]."""
  leading = x.shape[:-1]
  y = fn(x.reshape(-1, x.shape[-1]))
  return y.reshape(*leading, y.shape[-1])


class Dense(nnx.Linear):
  """`nnx.Linear` over the last axis of `[..., in_features]`, as one 2D matmul. -> `[..., out_features]`."""

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if inputs.ndim < 1 or inputs.shape[-1] != self.in_features:
      raise ValueError(f"Dense: inputs must be [..., {self.in_features}], got inputs{list(inputs.shape)}")
    return flat_matmul(inputs, super().__call__)
