"""Description distillation (task.distill_weight, the bundled strips only): the frozen LM's residual stream on
each training example's text with its images described in words, computed once before training, and the loss
term that pulls the VLM's LM states, reading the images, toward those states.

The positions compared are each image's marker and every text token after the first image (the training
Layout's teacher_ids and teacher_index); the term is weighed by task.distill_weight beside the cross-entropy
(experiments/results/intel_xeon_amx/vlm_description_distillation.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from xattn_jax.data import batching
from xattn_jax.models import vlm
from xattn_jax.training import validation

# task.distill_weight holds the frozen LM's states on the described training texts in host memory, up to this
# size; a larger training set is refused before training (those states are what the distillation reads).
DESCRIBED_STATES_MAX_BYTES = 2 << 30


def described_states(layouts, lm_model, make_lm, *, blocks: int, weight: float,
                     chunk: int = 256) -> list[np.ndarray]:
  """The frozen LM's residual stream on each training layout's described text (Layout teacher_ids), after its
  first `blocks` blocks (task.distill_blocks; 0: all), computed once (the LM is frozen) -> per layout float32
  [positions compared, blocks, d_lm], the positions where its teacher_index >= 0. lm_model: the frozen LM's
  model config; make_lm(): the frozen LM with its weights; weight: task.distill_weight (named in errors)."""
  blocks = blocks or lm_model.num_layers
  if blocks > lm_model.num_layers:
    raise validation.ConfigError("task.distill_blocks", blocks,
                                 f"must be at most the frozen LM's {lm_model.num_layers} blocks (0: all)")
  compared = sum(int(np.sum(layout.teacher_index >= 0)) for layout in layouts)
  size = compared * blocks * lm_model.d_model * 4
  if size > DESCRIBED_STATES_MAX_BYTES:
    raise validation.ConfigError("task.distill_weight", weight,
                                 f"the frozen LM's states on the {len(layouts)} described training "
                                 f"texts would take {size / 2**30:.1f} GiB (at most "
                                 f"{DESCRIBED_STATES_MAX_BYTES / 2**30:.1f}): fewer data.num_train_examples, fewer "
                                 f"task.distill_blocks, or 0")
  lm = make_lm()
  read = nnx.jit(lambda lm, tokens: jnp.stack(vlm.lm_hidden_states(lm, tokens)[:blocks], axis=2))
  width = batching.round_up(max(len(layout.teacher_ids) for layout in layouts), 8)
  states = []
  for start in range(0, len(layouts), chunk):
    part = layouts[start:start + chunk]
    tokens = np.zeros((chunk, width), np.int32)  # one shape: one compiled program
    for row, layout in enumerate(part):
      tokens[row, :len(layout.teacher_ids)] = layout.teacher_ids
    hidden = np.asarray(read(lm, tokens))  # [chunk, width, blocks, d]
    states += [hidden[row, layout.teacher_index[layout.teacher_index >= 0]] for row, layout in enumerate(part)]
  logging.info("task.distill_weight: the frozen LM's states on %d described texts cached (%.0f MiB)",
               len(states), size / 2**20)
  return states


def description_distillation(student, target, mask) -> jax.Array:
  """How far the LM's residual stream reading the images is from the same LM's reading their descriptions.

  student: the residual after each of the LM's first n blocks with the images, [b, T, d] each
  (`VisionLanguageModel.forward`'s hidden); target [b, T, n, d]: the same LM's states on the described texts
  (`vlm.lm_hidden_states`), each at the position of the same token; mask bool [b, T]: the positions compared
  (an image's marker and the text after it). -> the mean over blocks of the squared error relative to the
  target's squared norm, both summed over the compared positions (0 when none).
  """
  if not student or target.ndim != 4 or target.shape[2] != len(student) or \
      target.shape[:2] + target.shape[3:] != student[0].shape or mask.shape != target.shape[:2]:
    raise ValueError(f"description_distillation: target must be [b, T, blocks, d] = "
                     f"{list(student[0].shape[:2]) + [len(student)] + list(student[0].shape[2:]) if student else '?'} "
                     f"and mask [b, T], got target{list(target.shape)}, mask{list(mask.shape)}")
  weight = mask.astype(jnp.float32)[..., None]
  errors = []
  for block, states in enumerate(student):
    reference = target[:, :, block].astype(jnp.float32)
    error = jnp.sum(weight * jnp.square(states.astype(jnp.float32) - reference))
    errors.append(error / jnp.maximum(jnp.sum(weight * jnp.square(reference)), 1e-6))
  return sum(errors) / len(errors)
