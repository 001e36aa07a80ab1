"""The `task.decoding` section every decoding task shares, read once into a decoding.DecodingOptions.

  task.decoding.method       greedy | beam | sample, or a registered one (decoding.DECODING_METHODS)
  task.decoding.beam_size    beam: hypotheses kept (>= 1)
  task.decoding.alpha        beam: GNMT length-penalty exponent (>= 0)
  task.decoding.temperature  sample: softmax temperature (> 0, float32's smallest normal at least)
  task.decoding.top_k        sample: keep the k most likely tokens (0 = all)
  task.decoding.top_p        sample: nucleus mass (in (0, 1], 1 = no cut)
  task.decoding.seed         sample (a method that draws: decoding.DecodingMethod.draws): the PRNG seed of the
                             per-row keys (>= 0)
  task.decoding.cache_halves every method: a cache of 64+ positions decodes its first half on that half alone
                             (True, default; 1.5x the cache's memory meanwhile) or in one loop (False)
Each method reads the options its decoding.DECODING_METHODS entry's `reads` lists, and cache_halves, and the seed
where it `draws`; an option the chosen method does not read, set away from its decoding.DecodingOptions default (a
temperature beside method=greedy), or a seed other than 0 beside a method that draws nothing, is named in a
warning: the decode goes on without it (a run's recorded section stays usable with another method). A task may
add its own fields to the section (the LM's max_new_tokens); they are not read here.
"""
from __future__ import annotations

import jax
import numpy as np
from absl import logging

from xattn_jax import decoding
from xattn_jax.training import validation

SECTION = "task.decoding"
_SAID_UNREAD = set()  # (field, value, method) of the unread options warned about in this process


def decoding_options(config) -> decoding.DecodingOptions:
  """config.task.decoding as a DecodingOptions; a bad field (or a missing section) is one ConfigError
  line naming task.decoding.<field>."""
  if "decoding" not in config.task:
    options = ", ".join(field for field in (*decoding.OPTION_FIELDS, "seed") if field != "method")
    raise validation.ConfigError(SECTION, None, f"is required: a section with method "
                                 f"({' | '.join(decoding.DECODING_METHODS)}) and its options ({options})")
  section = config.task.decoding
  try:
    options = decoding.options_from_mapping(section)
  except decoding.DecodingOptionError as error:
    raise validation.ConfigError(f"{SECTION}.{error.field}", error.value,
                                 str(error).removeprefix("decoding: ")) from None
  if "seed" in section:
    validation.require_positive(config, f"{SECTION}.seed", allow_zero=True)
  unread = [(field, getattr(options, field), readers) for field, readers in decoding.unread_options(options)]
  if section.get("seed", 0) and not decoding.DECODING_METHODS[options.method].draws:
    unread.append(("seed", section.seed, tuple(name for name, method in decoding.DECODING_METHODS.items()
                                               if method.draws)))
  for field, value, readers in unread:
    said = (field, value, options.method)
    if said in _SAID_UNREAD:  # validate and the task's setup both read the section: one warning
      continue
    _SAID_UNREAD.add(said)
    logging.warning("%s.%s=%r is read by method=%s only: method=%s decodes without it", SECTION, field, value,
                    " | ".join(readers), options.method)
  return options


def note_top_k(config, vocab_size: int) -> None:
  """Says where sampling's top_k keeps every one of the model's `vocab_size` tokens (it cuts nothing)."""
  section = config.task.decoding
  top_k = section.get("top_k", 0)
  if section.get("method") == "sample" and top_k and top_k >= vocab_size:
    logging.warning("%s.top_k=%d keeps every one of the vocabulary's %d tokens: no top-k cut", SECTION, top_k,
                    vocab_size)


def row_keys(config, rows: int, offset: int = 0, ids=None) -> jax.Array:
  """PRNG keys [rows] for sampling rows offset .. offset + rows - 1 of a decode: key i depends only on
  task.decoding.seed and i, so a row's sample does not depend on how the rows are batched. `ids` ([rows] or
  [rows, n] ints) names each row instead (an inference's input line, and the row's place in it): then a row's
  sample does not depend on the other rows either."""
  base = jax.random.key(config.task.decoding.get("seed", 0))
  ids = np.arange(offset, offset + rows) if ids is None else np.asarray(ids)
  ids = ids.reshape(rows, -1).astype(np.uint32)

  def key(row):
    out = base
    for index in range(ids.shape[1]):
      out = jax.random.fold_in(out, row[index])
    return out

  return jax.vmap(key)(jax.numpy.asarray(ids))
