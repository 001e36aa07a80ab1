"""Optimizer, learning-rate schedule, weight-decay mask and the shared cross-entropy loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def make_schedule(optimizer_config, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate` over `warmup_steps`, then the named decay.

  cosine: down to `learning_rate * final_learning_rate_fraction` at `total_steps`.
  rsqrt:  `learning_rate * sqrt(warmup_steps / step)` (inverse square root, as in Vaswani et al.).
  constant: stays at `learning_rate`.
  """
  peak = optimizer_config.learning_rate
  warmup = optimizer_config.warmup_steps
  name = optimizer_config.schedule
  if name == "cosine":
    decay = optax.cosine_decay_schedule(
        peak, max(total_steps - warmup, 1), alpha=optimizer_config.final_learning_rate_fraction)
  elif name == "rsqrt":
    def decay(count):
      # `count` counts steps after warmup; the decay joins the warmup at the peak.
      return peak * jnp.sqrt(max(warmup, 1) / (count + max(warmup, 1)))
  elif name == "constant":
    decay = optax.constant_schedule(peak)
  else:
    raise ValueError(f"optimizer.schedule={name!r}: allowed are ['constant', 'cosine', 'rsqrt']")
  if warmup == 0:
    return decay
  warmup_schedule = optax.linear_schedule(0.0, peak, warmup)
  return optax.join_schedules([warmup_schedule, decay], [warmup])


def weight_decay_mask(params, exclude: str):
  """True where weight decay applies: matrices whose path contains none of the `exclude` substrings.

  `params` is a pytree (e.g. an nnx.State of Params); `exclude` a comma-separated list such as
  "bias,scale,embedding". Vectors and scalars (biases, norm scales) are never decayed.
  """
  patterns = [p.strip() for p in exclude.split(",") if p.strip()]

  def decays(path, leaf):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return jnp.ndim(leaf) >= 2 and not any(p in name for p in patterns)

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(optimizer_config, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW / Adam / SGD with the configured schedule."""
  schedule = make_schedule(optimizer_config, total_steps)
  name = optimizer_config.name
  if name == "adamw":
    tx = optax.adamw(schedule, b1=optimizer_config.b1, b2=optimizer_config.b2,
                     eps=optimizer_config.eps, weight_decay=optimizer_config.weight_decay,
                     mask=lambda params: weight_decay_mask(params, optimizer_config.weight_decay_exclude))
  elif name == "adam":
    tx = optax.adam(schedule, b1=optimizer_config.b1, b2=optimizer_config.b2, eps=optimizer_config.eps)
  elif name == "sgd":
    tx = optax.sgd(schedule, momentum=optimizer_config.momentum)
  else:
    raise ValueError(f"optimizer.name={name!r}: allowed are ['adam', 'adamw', 'sgd']")
  if optimizer_config.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(optimizer_config.grad_clip_norm), tx)
  return tx


def cross_entropy(logits, targets, weights=None, label_smoothing: float = 0.0):
  """Summed token cross-entropy in float32 and the summed weight.

  logits [..., vocab], targets [...] int, weights [...] (e.g. `targets != 0`; None = all ones).
  With smoothing eps the target distribution is (1 - eps) * one_hot + eps / vocab: the loss is not
  shifted by its minimum (the smoothed distribution's entropy), so it stays a true cross-entropy.
  Returns (sum of weighted losses, sum of weights); divide them for the mean.
  """
  if logits.shape[:-1] != targets.shape:
    raise ValueError(f"cross_entropy: targets must be logits.shape[:-1]={list(logits.shape[:-1])}, "
                     f"got targets{list(targets.shape)}")
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing}")
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  elif weights.shape != targets.shape:
    raise ValueError(f"cross_entropy: weights must be targets.shape={list(targets.shape)}, "
                     f"got weights{list(weights.shape)}")
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  vocab = logits.shape[-1]
  soft_targets = optax.smooth_labels(jax.nn.one_hot(targets, vocab, dtype=jnp.float32), label_smoothing)
  losses = -jnp.sum(soft_targets * log_probs, axis=-1)  # [...]
  weights = weights.astype(jnp.float32)
  return jnp.sum(losses * weights), jnp.sum(weights)
