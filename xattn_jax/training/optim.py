"""Optimizer, learning-rate schedule, weight-decay mask and the shared cross-entropy loss.

OPTIMIZERS and SCHEDULES are the one list of each choice (config validation reads them): adding
one is one function and one entry, which names the optimizer.* fields the choice reads. Code outside the package
adds one with `register_optimizer` / `register_schedule`, so that a run's recorded config.py imports it again.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from xattn_jax import registry


def _cosine(optimizer_config, total_steps: int) -> optax.Schedule:
  """Down to `learning_rate * final_learning_rate_fraction` at `total_steps`."""
  return optax.cosine_decay_schedule(optimizer_config.learning_rate,
                                     max(total_steps - optimizer_config.warmup_steps, 1),
                                     alpha=optimizer_config.final_learning_rate_fraction)


def _rsqrt(optimizer_config, total_steps: int) -> optax.Schedule:
  """`learning_rate * sqrt(warmup_steps / step)` (inverse square root, as in Vaswani et al.)."""
  del total_steps
  peak, warmup = optimizer_config.learning_rate, max(optimizer_config.warmup_steps, 1)

  def decay(count):
    # `count` counts steps after warmup; the decay joins the warmup at the peak.
    return peak * jnp.sqrt(warmup / (count + warmup))

  return decay


def _constant(optimizer_config, total_steps: int) -> optax.Schedule:
  del total_steps
  return optax.constant_schedule(optimizer_config.learning_rate)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One entry of OPTIMIZERS or SCHEDULES. build: (optimizer config, schedule or total_steps) -> the update rule or
  the decay; reads: the optimizer.* fields it uses beyond learning_rate, warmup_steps and grad_clip_norm, which every
  choice uses (the others are said to be unused, and weight_decay_exclude is checked only where it is read)."""
  build: Callable
  reads: tuple[str, ...] = ()


# optimizer.schedule -> (optimizer config, total_steps) -> the decay after warmup.
SCHEDULES: dict[str, Choice] = {"cosine": Choice(_cosine, ("final_learning_rate_fraction",)),
                                "rsqrt": Choice(_rsqrt), "constant": Choice(_constant)}


def _chosen(registry: dict, field: str, name: str):
  if name not in registry:
    raise ValueError(f"{field}={name!r}: allowed are {sorted(registry)}")
  return registry[name]


def make_schedule(optimizer_config, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate` over `warmup_steps`, then the SCHEDULES decay named
  by `optimizer_config.schedule`."""
  warmup = optimizer_config.warmup_steps
  decay = _chosen(SCHEDULES, "optimizer.schedule", optimizer_config.schedule).build(optimizer_config, total_steps)
  if warmup == 0:
    return decay
  warmup_schedule = optax.linear_schedule(0.0, optimizer_config.learning_rate, warmup)
  return optax.join_schedules([warmup_schedule, decay], [warmup])


# optimizer.weight_decay_exclude's default (configs/common.py reads it): a model need not have all three.
DEFAULT_WEIGHT_DECAY_EXCLUDE = "bias,scale,embedding"


def _exclude_patterns(exclude: str) -> list[str]:
  return [p.strip() for p in exclude.split(",") if p.strip()]


def path_name(path) -> str:
  """A leaf's path as "a/0/b"; an nnx.Variable's own `.value` attribute, at the end of every parameter's path as
  optax sees it, is not part of the name (a substring "value" would otherwise match every parameter)."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path
                  if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"))


def parameter_names(params) -> list[str]:
  """Each leaf's path in `params` as "a/0/b", the names weight_decay_exclude's substrings are matched against."""
  return [path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def weight_decay_mask(params, exclude: str):
  """True where weight decay applies: matrices whose path contains none of the `exclude` substrings.

  `params` is a pytree (e.g. an nnx.State of Params); `exclude` a comma-separated list such as
  "bias,scale,embedding". Vectors and scalars (biases, norm scales) are never decayed.
  """
  patterns = _exclude_patterns(exclude)

  def decays(path, leaf):
    return jnp.ndim(leaf) >= 2 and not any(p in path_name(path) for p in patterns)

  return jax.tree_util.tree_map_with_path(decays, params)


def unmatched_exclude_patterns(params, exclude: str) -> list[str]:
  """The `exclude` substrings outside DEFAULT_WEIGHT_DECAY_EXCLUDE that no path of `params` contains: a
  misspelt name would otherwise exclude nothing, silently."""
  names = parameter_names(params)
  defaults = set(_exclude_patterns(DEFAULT_WEIGHT_DECAY_EXCLUDE))
  return [p for p in _exclude_patterns(exclude) if p not in defaults and not any(p in n for n in names)]


def _adamw(c, schedule) -> optax.GradientTransformation:
  return optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay,
                     mask=lambda params: weight_decay_mask(params, c.weight_decay_exclude))


def _adam(c, schedule) -> optax.GradientTransformation:
  return optax.adam(schedule, b1=c.b1, b2=c.b2, eps=c.eps)


def _sgd(c, schedule) -> optax.GradientTransformation:
  return optax.sgd(schedule, momentum=c.momentum)


# optimizer.name -> (optimizer config, learning-rate schedule) -> the update rule.
OPTIMIZERS: dict[str, Choice] = {
    "adamw": Choice(_adamw, ("b1", "b2", "eps", "weight_decay", "weight_decay_exclude")),
    "adam": Choice(_adam, ("b1", "b2", "eps")),
    "sgd": Choice(_sgd, ("momentum",)),
}


def _register(function: str, choices: dict, name: str, build: Callable, reads, replace: bool) -> None:
  registry.check_new_name(function, choices, name, replace=replace)
  if not callable(build):
    raise ValueError(f"{function}: build must be callable, got {type(build).__name__}")
  if isinstance(reads, str) or not isinstance(reads, (tuple, list)) or not all(isinstance(f, str) for f in reads):
    raise ValueError(f"{function}: reads must be a tuple of optimizer.* field names, got reads={reads!r}")
  registry.add(function, choices, name, Choice(build, tuple(reads)))


def register_optimizer(name: str, build: Callable, *, reads: tuple[str, ...] = (), replace: bool = False) -> None:
  """Adds Choice(build, reads) to OPTIMIZERS as `name`: optimizer.name and config validation take it from then on.
  build(optimizer config, schedule) -> optax.GradientTransformation; reads: the optimizer.* fields it uses (see
  Choice). Register it before the config is validated: a run of launch.py registers it from a module its config
  file imports. ValueError for a name that is not a non-empty str, or is registered already (unless replace), a
  build that is not callable, or reads that are not a tuple of names."""
  _register("register_optimizer", OPTIMIZERS, name, build, reads, replace)


def register_schedule(name: str, build: Callable, *, reads: tuple[str, ...] = (), replace: bool = False) -> None:
  """Adds Choice(build, reads) to SCHEDULES as `name` (optimizer.schedule), as `register_optimizer` does;
  build(optimizer config, total_steps) -> the optax schedule after warmup."""
  _register("register_schedule", SCHEDULES, name, build, reads, replace)


def reads(optimizer_config, field: str) -> bool:
  """Whether the chosen optimizer or schedule uses optimizer.<field> (one that only some choices read)."""
  return any(field in registry[name].reads for registry, name in ((OPTIMIZERS, optimizer_config.name),
                                                                  (SCHEDULES, optimizer_config.schedule)))


# The defaults of the optimizer.* fields only some choices read (configs/common.py takes them from here).
CHOICE_FIELD_DEFAULTS = {
    "final_learning_rate_fraction": 0.0,  # cosine ends at learning_rate * this
    "b1": 0.9, "b2": 0.98, "eps": 1e-9,  # adam, adamw
    "momentum": 0.9,  # sgd
    "weight_decay": 0.01,  # adamw
    # adamw: parameters whose path contains one of these substrings get no weight decay; vectors (biases, norm
    # scales) never do. A name in no trainable parameter's path is refused (the default's are kept).
    "weight_decay_exclude": DEFAULT_WEIGHT_DECAY_EXCLUDE,
}


def unread_fields(optimizer_config) -> list[str]:
  """The optimizer.* fields some choice reads that the chosen optimizer and schedule do not, set otherwise than
  their defaults (CHOICE_FIELD_DEFAULTS): a value the run does not use (adam takes no weight decay; only the
  cosine schedule ends at final_learning_rate_fraction). A default left as it is is no news."""
  fields = {field for registry in (OPTIMIZERS, SCHEDULES) for choice in registry.values() for field in choice.reads}
  return sorted(field for field in fields if field in optimizer_config and not reads(optimizer_config, field)
                and optimizer_config[field] != CHOICE_FIELD_DEFAULTS.get(field))


def make_optimizer(optimizer_config, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then the OPTIMIZERS entry named by `optimizer_config.name` with the
  configured schedule."""
  schedule = make_schedule(optimizer_config, total_steps)
  tx = _chosen(OPTIMIZERS, "optimizer.name", optimizer_config.name).build(optimizer_config, schedule)
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
