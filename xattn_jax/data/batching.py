"""Fixed-shape numpy batches of tokenized (source, target) pairs for an encoder-decoder (host side).

A batch is a dict of int32 arrays, 0 = padding everywhere:

  inputs          [batch, S]  source ids
  targets         [batch, T]  target ids followed by EOS (what the decoder must predict)
  decoder_inputs  [batch, T]  BOS followed by targets[:-1] (teacher forcing), so
                              decoder_inputs[:, 0] == BOS and decoder_inputs[:, 1:] == targets[:, :-1]
                              within each example

Lengths, key-padding masks and loss weights follow from ``!= 0``. With packing, rows hold several
examples and four more arrays say which (as in flax's examples/wmt):

  inputs_segmentation, targets_segmentation  [batch, S] / [batch, T]  1, 2, ... per example, 0 = padding
  inputs_position, targets_position          [batch, S] / [batch, T]  0, 1, ... restarting per example

``train_batch`` is a pure function of (seed, step, process_index, process_count): epoch e uses the
permutation seeded by (seed, e) and the step picks a slice of it, so the step IS the position in the
data stream and a resumed run sees exactly the batches it would have seen. Each epoch drops the
remainder of ``num_units // batch_size`` (a different remainder each epoch); data smaller than one batch
fill it by repeating (``epoch_order``), so a small corpus trains at any batch size. Every process takes its
contiguous slice of the global batch; shapes are decided on the global batch, so all processes agree.

Examples longer than ``max_source_length`` / ``max_target_length`` are TRUNCATED (not dropped), with
one warning that counts them; a truncated target keeps its EOS as the last token.
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from xattn_jax.data import tokenizers


def steps_per_epoch(num_units: int, batch_size: int) -> int:
  """Global batches per epoch of ``num_units`` examples or rows: ``num_units // batch_size``, at least 1."""
  if num_units < 1:
    raise ValueError(f"no training examples to batch (num_units={num_units})")
  return max(1, num_units // batch_size)


def epoch_order(rng: np.random.Generator, num_units: int, batch_size: int) -> np.ndarray:
  """One epoch's units in batch order, [steps_per_epoch(num_units, batch_size) * batch_size] indices.

  A permutation of the units, cut to whole batches (the remainder dropped). Units fewer than one batch
  make a one-batch epoch of consecutive permutations cut at ``batch_size``: every unit appears
  ``batch_size // num_units`` or one more times, which units get the extra copy changing every epoch.
  """
  steps = steps_per_epoch(num_units, batch_size)
  if num_units >= batch_size:
    return rng.permutation(num_units)[:steps * batch_size]
  return np.concatenate([rng.permutation(num_units) for _ in range(-(-batch_size // num_units))])[:batch_size]


class EpochOrder:
  """The units of global batch ``step`` when epoch e takes them in ``epoch_order`` under the rng seeded by
  (seed, e): a pure function of (seed, step, batch_size), the latest epoch's order cached (consecutive steps
  share an epoch).

  With ``sort_keys`` (per unit an integer, e.g. its image count, or a row of integers compared in order, e.g.
  padded source and target lengths) the epoch's permutation is stably sorted by key before it is cut into
  batches, so a batch holds units of one key wherever the counts allow (bucketing: a batch pads only to its
  own units' shape); the batches then come in a random order.
  """

  def __init__(self, num_units: int, sort_keys: np.ndarray | None = None):
    keys = None if sort_keys is None else np.asarray(sort_keys)
    if keys is not None and (keys.shape[:1] != (num_units,) or not 1 <= keys.ndim <= 2):
      raise ValueError(f"EpochOrder: sort_keys must be [num_units={num_units}] or [num_units={num_units}, keys], "
                       f"got {list(keys.shape)}")
    self.num_units = num_units
    self.sort_keys = None if keys is None else keys[:, None] if keys.ndim == 1 else keys  # [num_units, keys]
    self._cache: tuple = (None, None)

  def batch(self, step: int, seed: int, batch_size: int) -> np.ndarray:
    """Unit indices of global batch ``step``: [batch_size]."""
    steps = steps_per_epoch(self.num_units, batch_size)
    epoch, step_in_epoch = divmod(step, steps)
    key = (seed, epoch, batch_size)
    if self._cache[0] != key:
      rng = np.random.default_rng([seed, epoch])
      order = epoch_order(rng, self.num_units, batch_size)
      batches = order.reshape(steps, batch_size)
      if self.sort_keys is not None:  # lexsort: the last key it is given sorts first, and it is stable
        batches = order[np.lexsort(self.sort_keys[order].T[::-1])].reshape(steps, batch_size)
        batches = batches[rng.permutation(steps)]
      self._cache = (key, batches)
    return self._cache[1][step_in_epoch]


def repeats_per_batch(num_units: int, batch_size: int) -> str:
  """How often a batch holds each unit when there are fewer than batch_size: "3 times", "1 or 2 times"."""
  low, high = batch_size // num_units, -(-batch_size // num_units)
  return f"{low} times" if low == high else f"{low} or {high} times"


def round_up(length: int, multiple: int) -> int:
  """The smallest multiple of ``multiple`` that is >= max(length, 1)."""
  return -(-max(length, 1) // multiple) * multiple


def tokenize_pairs(pairs: Sequence[tuple[str, str]], tokenizer: tokenizers.Tokenizer,
                   target_tokenizer: tokenizers.Tokenizer | None = None) -> list[tuple[list[int], list[int]]]:
  """Encodes (source, target) text pairs; the target side uses ``target_tokenizer`` if given."""
  target_tokenizer = target_tokenizer or tokenizer
  sources = tokenizer.encode_batch([source for source, _ in pairs])
  targets = target_tokenizer.encode_batch([target for _, target in pairs])
  return list(zip(sources, targets))


class _Ragged:
  """Variable-length int32 sequences stored flat: sequence i is data[starts[i]:starts[i] + lengths[i]]."""

  def __init__(self, sequences: Sequence[Sequence[int]]):
    self.lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
    self.data = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(self.lengths.sum()))

  def __getitem__(self, i: int) -> np.ndarray:
    return self.data[self.starts[i]:self.starts[i] + self.lengths[i]]


def _check_no_special_ids(name: str, sequences: _Ragged, bos_id: int, eos_id: int) -> None:
  """Raises ValueError naming the first example whose ids include pad, BOS, EOS or a negative id:
  inside a row they would read as padding or as the end of the sentence."""
  special = np.isin(sequences.data, [0, bos_id, eos_id]) | (sequences.data < 0)
  if special.any():
    position = int(np.argmax(special))
    example = int(np.searchsorted(sequences.starts, position, side="right") - 1)
    raise ValueError(f"examples[{example}] {name} holds id {int(sequences.data[position])}: ids must be positive "
                     f"and not pad (0), bos_id ({bos_id}) or eos_id ({eos_id})")


class TranslationBatches:
  """Batches of one split's examples: deterministic training batches and exhaustive eval batches.

  Args:
    examples: (source ids, target ids) per example, without BOS / EOS; no id may be pad, BOS or
      EOS, and a source may not be empty.
    bos_id, eos_id: decoder start and end ids (pad is always 0).
    max_source_length, max_target_length: S and T, the row lengths (T counts the EOS). None: the
      longest example, rounded up to ``pad_multiple``, but at most ``length_limit`` (e.g. the model's
      positions). Longer examples are truncated, with a warning.
    length_bucketing: each epoch is sorted by padded (source, target) length before being cut into
      batches (the batch order is then shuffled: ``EpochOrder``), and a batch is padded only to its own
      longest example rounded up to ``pad_multiple``; shapes come from the bounded set {pad_multiple,
      2 * pad_multiple, ..., S} x {..., T}, so jit compiles a bounded number of times.
    packing: examples are packed once, next-fit in a fixed shuffled order, into rows of length S and
      T, and training samples rows instead of examples. Packing is fixed across epochs (only the row
      order changes) so that a step maps to its batch in O(1). Eval batches are never packed.
    pad_multiple: the rounding for derived and bucketed lengths.
  """

  def __init__(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], *, bos_id: int = tokenizers.BOS_ID,
               eos_id: int = tokenizers.EOS_ID, max_source_length: int | None = None,
               max_target_length: int | None = None, length_bucketing: bool = False, packing: bool = False,
               pad_multiple: int = 8, length_limit: int | None = None):
    if not isinstance(examples, Sequence) or len(examples) == 0:
      raise ValueError(f"examples must be a non-empty sequence of (source ids, target ids), got {type(examples).__name__}"
                       f"{'' if not isinstance(examples, Sequence) else ' of length 0'}")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_multiple", pad_multiple)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if bos_id == eos_id:
      raise ValueError(f"bos_id and eos_id must differ, got {bos_id} for both")
    if length_bucketing and packing:
      raise ValueError("length_bucketing and packing are alternatives (packed rows are already full); choose one")
    for i, example in enumerate(examples):
      if len(example) != 2:
        raise ValueError(f"examples[{i}] must be a (source ids, target ids) pair, got {len(example)} items")
      if len(example[0]) == 0:
        raise ValueError(f"examples[{i}] has an empty source; every example needs at least one source token")
    self.bos_id, self.eos_id, self.pad_multiple = int(bos_id), int(eos_id), int(pad_multiple)
    self.length_limit = length_limit
    self.length_bucketing, self.packing = bool(length_bucketing), bool(packing)

    source = _Ragged([s for s, _ in examples])
    target = _Ragged([t for _, t in examples])
    for name, ragged in (("source", source), ("target", target)):
      _check_no_special_ids(name, ragged, self.bos_id, self.eos_id)

    self.max_source_length = self._row_length("max_source_length", max_source_length, source.lengths.max())
    self.max_target_length = self._row_length("max_target_length", max_target_length, target.lengths.max() + 1)
    if self.max_target_length < 2:
      raise ValueError(f"max_target_length must be >= 2 (one target token plus EOS), got {self.max_target_length}")
    truncated = (source.lengths > self.max_source_length) | (target.lengths + 1 > self.max_target_length)
    self.truncated = np.flatnonzero(truncated)  # indices into examples
    self.num_truncated = len(self.truncated)
    if self.num_truncated:
      first = int(np.argmax(truncated))
      warnings.warn(f"{self.num_truncated} of {len(examples)} examples are longer than max_source_length="
                    f"{self.max_source_length} or max_target_length={self.max_target_length} (EOS included) "
                    f"and were truncated; the first is example {first} (0-based, in the order given)",
                    stacklevel=2)
    self._source = source
    self._target = target
    self.source_lengths = np.minimum(source.lengths, self.max_source_length)           # [num_examples]
    self.target_lengths = np.minimum(target.lengths + 1, self.max_target_length)       # [num_examples], EOS included
    self._rows = self._pack() if packing else None  # list of example-index arrays, one per packed row
    # [num_examples, 2]: (source, target) lengths in units of pad_multiple, rounded up. Bucketing sorts by
    # them: a batch of one key pads to one shape.
    self.length_buckets = -(-np.stack([self.source_lengths, self.target_lengths], 1) // self.pad_multiple)
    self._order = EpochOrder(self.num_units, self.length_buckets if self.length_bucketing else None)

  @classmethod
  def from_pairs(cls, pairs: Sequence[tuple[str, str]], tokenizer: tokenizers.Tokenizer,
                 target_tokenizer: tokenizers.Tokenizer | None = None, **kwargs) -> "TranslationBatches":
    """Tokenizes (source, target) text pairs and batches them; ``kwargs`` as for the constructor.

    BOS / EOS ids are the target tokenizer's.
    """
    target_tokenizer = target_tokenizer or tokenizer
    return cls(tokenize_pairs(pairs, tokenizer, target_tokenizer), bos_id=target_tokenizer.bos_id,
               eos_id=target_tokenizer.eos_id, **kwargs)

  def _row_length(self, name: str, value, longest: int) -> int:
    if value is None:
      derived = round_up(int(longest), self.pad_multiple)
      return derived if self.length_limit is None else min(derived, self.length_limit)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return int(value)

  @property
  def num_examples(self) -> int:
    return len(self.source_lengths)

  @property
  def num_units(self) -> int:
    """What training samples: examples, or packed rows when packing."""
    return len(self._rows) if self.packing else self.num_examples

  # ---------------------------------------------------------------- one example's arrays

  def _source_ids(self, i: int) -> np.ndarray:
    return self._source[i][:self.source_lengths[i]]

  def _target_ids(self, i: int) -> np.ndarray:
    """Target ids with EOS appended, truncated so that EOS stays last."""
    return np.append(self._target[i][:self.target_lengths[i] - 1], self.eos_id)

  # ---------------------------------------------------------------- packing

  def _pack(self) -> list[np.ndarray]:
    """Next-fit packing in a fixed shuffled order: a row is closed when the next example's source
    or target would overflow it."""
    order = np.random.default_rng(0).permutation(self.num_examples)
    rows, current, used_source, used_target = [], [], 0, 0
    for i in order:
      source_length, target_length = self.source_lengths[i], self.target_lengths[i]
      if current and (used_source + source_length > self.max_source_length
                      or used_target + target_length > self.max_target_length):
        rows.append(np.array(current))
        current, used_source, used_target = [], 0, 0
      current.append(i)
      used_source += source_length
      used_target += target_length
    rows.append(np.array(current))
    return rows

  # ---------------------------------------------------------------- array assembly

  def _assemble(self, rows: Sequence[Sequence[int]], source_length: int, target_length: int,
                segmented: bool) -> dict[str, np.ndarray]:
    """Arrays for rows of example indices, each row's examples laid end to end."""
    batch = len(rows)
    inputs = np.zeros((batch, source_length), np.int32)
    targets = np.zeros((batch, target_length), np.int32)
    decoder_inputs = np.zeros((batch, target_length), np.int32)
    if segmented:
      segmentation = {k: np.zeros((batch, n), np.int32) for k, n in
                      (("inputs", source_length), ("targets", target_length))}
      position = {k: np.zeros_like(v) for k, v in segmentation.items()}
    for r, row in enumerate(rows):
      source_at = target_at = 0
      for segment, i in enumerate(row, start=1):
        source_ids, target_ids = self._source_ids(i), self._target_ids(i)
        source_end, target_end = source_at + len(source_ids), target_at + len(target_ids)
        inputs[r, source_at:source_end] = source_ids
        targets[r, target_at:target_end] = target_ids
        decoder_inputs[r, target_at] = self.bos_id
        decoder_inputs[r, target_at + 1:target_end] = target_ids[:-1]
        if segmented:
          segmentation["inputs"][r, source_at:source_end] = segment
          segmentation["targets"][r, target_at:target_end] = segment
          position["inputs"][r, source_at:source_end] = np.arange(len(source_ids))
          position["targets"][r, target_at:target_end] = np.arange(len(target_ids))
        source_at, target_at = source_end, target_end
    batch_arrays = {"inputs": inputs, "targets": targets, "decoder_inputs": decoder_inputs}
    if segmented:
      for k in ("inputs", "targets"):
        batch_arrays[f"{k}_segmentation"] = segmentation[k]
        batch_arrays[f"{k}_position"] = position[k]
    return batch_arrays

  # ---------------------------------------------------------------- training

  def steps_per_epoch(self, batch_size: int) -> int:
    """Global batches per epoch: ``num_units // batch_size``, at least 1 (see ``epoch_order``)."""
    _check_positive_int("batch_size", batch_size)
    return steps_per_epoch(self.num_units, batch_size)

  def train_batch(self, step: int, *, seed: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> dict[str, np.ndarray]:
    """This process's share of global training batch ``step``: arrays [batch_size // process_count, ...].

    A pure function of its arguments. ``batch_size`` is the GLOBAL batch size and must be divisible
    by ``process_count``; process p gets rows [p * b, (p + 1) * b) of the global batch, b =
    batch_size // process_count.
    """
    _check_nonnegative_int("step", step)
    _check_nonnegative_int("seed", seed)
    _check_positive_int("batch_size", batch_size)
    _check_process(process_index, process_count)
    if batch_size % process_count:
      raise ValueError(f"batch_size={batch_size} (global) must be divisible by process_count={process_count}")
    units = self._order.batch(int(step), int(seed), int(batch_size))  # [batch_size]
    local = batch_size // process_count
    local_units = units[process_index * local:(process_index + 1) * local]
    if self.packing:
      return self._assemble([self._rows[u] for u in local_units], self.max_source_length,
                            self.max_target_length, segmented=True)
    source_length, target_length = self.max_source_length, self.max_target_length
    if self.length_bucketing:
      source_length = min(round_up(int(self.source_lengths[units].max()), self.pad_multiple), source_length)
      target_length = min(round_up(int(self.target_lengths[units].max()), self.pad_multiple), target_length)
    return self._assemble([[u] for u in local_units], source_length, target_length, segmented=False)

  # ---------------------------------------------------------------- evaluation

  def num_eval_batches(self, batch_size: int) -> int:
    """Global eval batches: ceil(num_examples / batch_size)."""
    _check_positive_int("batch_size", batch_size)
    return -(-self.num_examples // batch_size)

  def eval_batches(self, batch_size: int, *, process_index: int = 0,
                   process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every example exactly once, in order, one per row, at the fixed shape [b, S] / [b, T].

    ``batch_size`` is global, as in ``train_batch``. Besides the usual arrays each batch has
    ``example_index`` [b] int32 (the example's position in ``examples``; -1 on padding) and
    ``example_weights`` [b] float32 (1 for a real example, 0 for the all-padding rows that fill the
    last batch).
    """
    _check_process(process_index, process_count)
    if batch_size % process_count:
      raise ValueError(f"batch_size={batch_size} (global) must be divisible by process_count={process_count}")
    local = batch_size // process_count
    for batch_number in range(self.num_eval_batches(batch_size)):
      start = batch_number * batch_size + process_index * local
      indices = np.arange(start, start + local)
      indices = np.where(indices < self.num_examples, indices, -1).astype(np.int32)
      rows = [[i] if i >= 0 else [] for i in indices]
      batch = self._assemble(rows, self.max_source_length, self.max_target_length, segmented=False)
      batch["example_index"] = indices
      batch["example_weights"] = (indices >= 0).astype(np.float32)
      yield batch


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_nonnegative_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _check_process(process_index, process_count) -> None:
  _check_positive_int("process_count", process_count)
  _check_nonnegative_int("process_index", process_index)
  if process_index >= process_count:
    raise ValueError(f"process_index must be in [0, process_count={process_count}), got {process_index}")
