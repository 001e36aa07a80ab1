"""Algorithmic sequence-to-sequence data for length generalization: copy or reverse a random string.

Token ids share the tokenizers' specials: 0 = padding, 1 = BOS, 2 = EOS; symbols are 3 ..
3 + num_symbols - 1. An example s of length n gives

  inputs          s                 (n ids)
  targets         f(s) + [EOS]      (n + 1 ids; f = identity for "copy", reversal for "reverse")
  decoder_inputs  [BOS] + f(s)      (teacher forcing: targets shifted right by one)

in the layout of `data.batching` (0 = padding everywhere), padded to fixed widths so that every
batch of one length band has one shape (one compile).

Everything is a pure function of a numpy Generator, so a task can seed it by (seed, stream, step)
and resume exactly.
"""
from __future__ import annotations

import numpy as np

from xattn_jax.data.tokenizers import BOS_ID, EOS_ID, PAD_ID

FIRST_SYMBOL = 3
OPERATIONS = ("copy", "reverse")


def vocab_size(num_symbols: int) -> int:
  """Specials (pad, BOS, EOS) plus the symbols."""
  return FIRST_SYMBOL + num_symbols


def make_examples(rng: np.random.Generator, count: int, *, operation: str, min_length: int, max_length: int,
                  num_symbols: int, width: int | None = None) -> dict[str, np.ndarray]:
  """`count` examples with lengths drawn uniformly from [min_length, max_length].

  Returns int32 inputs [count, width], targets and decoder_inputs [count, width + 1], and lengths
  [count]; width defaults to max_length (a wider one pads more, e.g. to share a shape across bands).
  """
  width = max_length if width is None else width
  if operation not in OPERATIONS:
    raise ValueError(f"make_examples: operation must be one of {OPERATIONS}, got operation={operation!r}")
  if not 1 <= min_length <= max_length <= width:
    raise ValueError(f"make_examples: needs 1 <= min_length <= max_length <= width, got min_length={min_length}, "
                     f"max_length={max_length}, width={width}")
  if count < 1 or num_symbols < 2:
    raise ValueError(f"make_examples: needs count >= 1 and num_symbols >= 2, got count={count}, "
                     f"num_symbols={num_symbols}")
  lengths = rng.integers(min_length, max_length + 1, size=count)
  symbols = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + num_symbols, size=(count, width))
  columns = np.arange(width)[None, :]
  valid = columns < lengths[:, None]  # [count, width]
  inputs = np.where(valid, symbols, PAD_ID)
  if operation == "reverse":
    # Output position i reads input position n - 1 - i (clipped where i >= n, then masked).
    source = np.clip(lengths[:, None] - 1 - columns, 0, None)
    outputs = np.where(valid, np.take_along_axis(inputs, source, axis=1), PAD_ID)
  else:
    outputs = inputs
  targets = np.concatenate([outputs, np.full((count, 1), PAD_ID)], axis=1)  # [count, width + 1]
  targets[np.arange(count), lengths] = EOS_ID
  # BOS + targets[:-1], cut where the targets end (the EOS is never fed back).
  decoder_inputs = np.concatenate([np.full((count, 1), BOS_ID), targets[:, :-1]], axis=1)
  decoder_inputs = np.where(targets == PAD_ID, PAD_ID, decoder_inputs)
  return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32),
          "decoder_inputs": decoder_inputs.astype(np.int32), "lengths": lengths.astype(np.int32)}
