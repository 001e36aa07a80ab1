"""Algorithmic sequences for a decoder-only model: `BOS input SEP output EOS`, scored on the output only.

Token ids: 0 = padding, 1 = BOS, 2 = EOS, symbols 3 .. 3 + num_symbols - 1, and SEP = 3 + num_symbols.
For an input string s of length n the output f(s) is (`OPERATIONS`):

  copy       s                                (n symbols)
  reverse    s reversed                       (n)
  sort       s in ascending symbol order      (n)
  duplicate  s twice                          (2n)
  parity     one symbol: the first if the second symbol occurs an even number of times in s,
             else the second                  (1)

The model reads `inputs` = BOS s SEP f(s) and predicts `targets` = s SEP f(s) EOS (the sequence
shifted by one); `weights` is 1 on the targets f(s) EOS only (the input is given, not learned).
Rows are padded to a fixed width per length band (one compiled shape).
"""
from __future__ import annotations

import numpy as np

from xattn_jax.data.tokenizers import BOS_ID, EOS_ID, PAD_ID

FIRST_SYMBOL = 3
OPERATIONS = ("copy", "reverse", "sort", "duplicate", "parity")
# The longest input of configs/lm_algorithmic.py's eval bands: its model.max_length is the row of this many symbols.
CONFIG_LONGEST_INPUT = 80


def vocab_size(num_symbols: int) -> int:
  """Specials (pad, BOS, EOS), the symbols and SEP."""
  return FIRST_SYMBOL + num_symbols + 1


def sep_id(num_symbols: int) -> int:
  return FIRST_SYMBOL + num_symbols


def output_length(operation: str, length: int) -> int:
  """len(f(s)) for an input of `length` symbols."""
  return {"duplicate": 2 * length, "parity": 1}.get(operation, length)


def apply(operation: str, symbols: np.ndarray) -> np.ndarray:
  """f(s) of one input string s (int ids [n])."""
  if operation == "copy":
    return symbols
  if operation == "reverse":
    return symbols[::-1]
  if operation == "sort":
    return np.sort(symbols)
  if operation == "duplicate":
    return np.concatenate([symbols, symbols])
  if operation == "parity":
    return np.array([FIRST_SYMBOL + int(np.sum(symbols == FIRST_SYMBOL + 1) % 2)])
  raise ValueError(f"operation must be one of {OPERATIONS}, got operation={operation!r}")


def row_width(operation: str, max_length: int) -> int:
  """Columns of a row holding inputs of up to max_length symbols: BOS s SEP f(s) (EOS is a target only)."""
  return max_length + 2 + output_length(operation, max_length)


def make_examples(rng: np.random.Generator, count: int, *, operation: str, min_length: int, max_length: int,
                  num_symbols: int, width: int | None = None) -> dict[str, np.ndarray]:
  """`count` examples, input lengths uniform in [min_length, max_length], rows padded to width.

  Returns int32 inputs / targets [count, width], float32 weights [count, width] and int32 lengths [count].
  """
  if operation not in OPERATIONS:
    raise ValueError(f"make_examples: operation must be one of {OPERATIONS}, got operation={operation!r}")
  if not 1 <= min_length <= max_length:
    raise ValueError(f"make_examples: needs 1 <= min_length <= max_length, got {min_length}, {max_length}")
  if count < 1 or num_symbols < 2:
    raise ValueError(f"make_examples: needs count >= 1 and num_symbols >= 2, got count={count}, "
                     f"num_symbols={num_symbols}")
  needed = row_width(operation, max_length)
  width = needed if width is None else width
  if width < needed:
    raise ValueError(f"make_examples: width={width} cannot hold {operation} rows of up to {max_length} symbols "
                     f"(needs {needed})")
  lengths = rng.integers(min_length, max_length + 1, size=count)
  inputs = np.zeros((count, width), np.int32)
  targets = np.zeros((count, width), np.int32)
  weights = np.zeros((count, width), np.float32)
  for row, n in enumerate(lengths):
    symbols = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + num_symbols, size=n)
    output = apply(operation, symbols)
    sequence = np.concatenate([[BOS_ID], symbols, [sep_id(num_symbols)], output, [EOS_ID]])
    used = len(sequence) - 1
    inputs[row, :used], targets[row, :used] = sequence[:-1], sequence[1:]
    weights[row, n + 1:used] = 1.0  # the targets f(s) EOS, read from SEP onward
  assert PAD_ID == 0
  return {"inputs": inputs, "targets": targets, "weights": weights, "lengths": lengths.astype(np.int32)}
