"""Position encodings as pure functions of explicit positions (H2 completes this module)."""
from __future__ import annotations

import jax.numpy as jnp


def sinusoidal(positions, dim: int, base: float = 10000.0):
  """p[t, 2i] = sin(t / base^(2i/dim)), p[t, 2i+1] = cos(...). positions [...] -> [..., dim]."""
  i = jnp.arange(dim // 2, dtype=jnp.float32)
  angles = jnp.asarray(positions, jnp.float32)[..., None] * base ** (-2.0 * i / dim)
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], dim)


def apply_rope(x, positions, *, base: float = 10000.0, layout: str = "split"):
  """Rotate x [batch, length, heads, head_dim] by positions [batch, length]."""
  h = x.shape[-1]
  freqs = base ** (-2.0 * jnp.arange(h // 2, dtype=jnp.float32) / h)
  angles = jnp.asarray(positions, jnp.float32)[..., None, None] * freqs  # [b, t, 1, h/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  if layout == "split":
    x1, x2 = xf[..., : h // 2], xf[..., h // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  else:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
  return out.astype(x.dtype)
