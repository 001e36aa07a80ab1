"""Plain text for a causal language model: one document per line, packed into fixed-shape rows.

Reading (``read_documents``) follows tsv.py: UTF-8, a leading byte-order mark and CRLF line ends are
accepted, and every bad line is reported in one error naming ``file:line``. A blank (or whitespace-
only) line holds no document and is skipped; a file with no document at all is an error. Text is
kept exactly as written.

Packing (``pack_documents``). A document of ids d_1..d_n is the token sequence BOS d_1 .. d_n EOS,
whose n + 1 next-token pairs (BOS -> d_1, ..., d_n -> EOS) are what the model learns. Rows are
``[rows, length]`` arrays:

  inputs       the token each position reads
  targets      the token that follows it in the same document (so a target never belongs to
               another document: pairs are cut per document, not from a shifted row)
  weights      1.0 on every pair, 0.0 on padding (and on a chunk's context, below)
  segment_ids  1, 2, ... for the segments of a row in order, 0 = padding
  positions    0, 1, ... restarting at every segment
  target_bytes (eval, when asked for) the UTF-8 bytes each scored target stands for, 0 elsewhere: a
               tokenizer-independent denominator (bits per byte)

A document with more than ``length`` pairs is split into chunks of ``length`` consecutive pairs (the
last one shorter). Each chunk is a segment of its own, with positions from 0: the model sees no
context across chunks, and the learned position table never needs more than ``length`` rows. The first
input of a continuation chunk is the previous chunk's last target, so no pair is lost. Chunks are laid
into rows best-fit (the fullest row that still has room), in an order shuffled by ``seed``: the rows
are a pure function of (documents, length, seed, context).

``context`` (evaluation: a sliding window, as long texts are scored in the literature): every chunk after a
document's first opens with the ``context`` pairs of the document before it, at weight 0, and scores the
``length - context`` pairs after them; the first chunk scores ``length``. Each pair is still scored exactly
once, each after at least ``context`` tokens of its document (or all of them), in a window of ``length``
positions from 0 as the model was trained.

``TextBatches`` serves the rows as batching.py serves examples: ``train_batch`` is a pure function of
(seed, step, process_index, process_count), epoch e taking the rows in the permutation seeded by
(seed, e) and dropping the remainder (rows fewer than one batch repeat to fill it,
``batching.epoch_order``); ``eval_batches`` yields every row once.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from xattn_jax.data import batching, files, tokenizers


class TextFormatError(files.LineFileError):
  """A text file is missing, not UTF-8, or holds no document (see files.LineFileError)."""
  heading = "invalid text file (expected UTF-8, one document per line)"
  bad_line = "bad line"


def read_documents(path) -> list[str]:
  """The non-blank lines of a UTF-8 text file, without their line ends, in file order.

  Raises:
    TextFormatError (a ValueError): the file is missing, not a regular file, UTF-16 (with a byte-order mark
      or without: NUL bytes), ends its lines with bare carriage returns, has a line that is not UTF-8 or
      holds a NUL byte or a bare carriage return (each named ``file:line``), or holds no non-blank line.
  """
  lines = files.read_line_bytes(path, TextFormatError, "a text file")
  documents, problems = [], []
  for line_number, raw in enumerate(lines, start=1):
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
      problems.append((line_number, f"not valid UTF-8 at byte {error.start + 1} of the line "
                                    f"({raw[error.start:error.start + 4]!r})"))
      continue
    if text.strip():
      documents.append(text)
  if problems:
    raise TextFormatError(path, problems)
  if not documents:
    raise TextFormatError(path, [(None, "no document: every line is blank")])
  return documents


def tokenize_documents(documents: Sequence[str], tokenizer: tokenizers.Tokenizer) -> list[list[int]]:
  """The ids of each document, without BOS / EOS."""
  return tokenizer.encode_batch(list(documents))


@dataclasses.dataclass(frozen=True)
class PackedText:
  """Documents packed into rows (see the module docstring); every array is [rows, length].

  ``segments`` says where each chunk's scored pairs went: int64 [num_segments, 5], columns (row, start in
  the row, number of pairs, document index, offset of its first pair within the document's pairs); a chunk's
  context (``pack_documents``' ``context``) sits just before its start.
  """
  inputs: np.ndarray       # int32
  targets: np.ndarray      # int32
  weights: np.ndarray      # float32: 1 on scored pairs, 0 on padding and context
  segment_ids: np.ndarray  # int32: 1.. per segment within the row, 0 = padding
  positions: np.ndarray    # int32: 0.. restarting per segment
  segments: np.ndarray     # int64 [num_segments, 5]
  # float32: the UTF-8 bytes each scored pair's target stands for (EOS: 1, the line end), 0 elsewhere; None
  # unless TextBatches was given them (with_target_bytes)
  target_bytes: np.ndarray | None = None

  @property
  def num_rows(self) -> int:
    return self.inputs.shape[0]

  @property
  def row_arrays(self) -> tuple[str, ...]:
    """The names of the [rows, length] arrays a batch holds."""
    names = ("inputs", "targets", "weights", "segment_ids", "positions")
    return names + (("target_bytes",) if self.target_bytes is not None else ())

  def arrays(self, rows) -> dict[str, np.ndarray]:
    """The named arrays of the given rows (an index array): a batch."""
    return {name: getattr(self, name)[rows] for name in self.row_arrays}

  def with_target_bytes(self, document_bytes: Sequence[Sequence[int]]) -> "PackedText":
    """These rows with ``target_bytes`` from each document's bytes per token (``Tokenizer.token_bytes``, one per
    id of the document as packed, as TextBatches checks; its EOS counts 1)."""
    values = [np.concatenate([np.asarray(b, np.float32).reshape(-1), [1.0]]) for b in document_bytes]
    target_bytes = np.zeros(self.weights.shape, np.float32)
    for row, start, pairs, document, offset in self.segments.tolist():
      target_bytes[row, start:start + pairs] = values[document][offset:offset + pairs]
    return dataclasses.replace(self, target_bytes=target_bytes)


def _check_int(name: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
  return int(value)


def pack_documents(documents: Sequence[Sequence[int]], length: int, *, bos_id: int = tokenizers.BOS_ID,
                   eos_id: int = tokenizers.EOS_ID, seed: int = 0, context: int = 0) -> PackedText:
  """Packs token-id documents (without BOS / EOS) into next-token rows [rows, length].

  No id may be pad (0), BOS, EOS or negative. Rows hold chunks of at most ``length`` pairs, and every
  pair of every document is scored (weight 1) in exactly one row; chunks of one document overlap only
  by the ``context`` pairs a continuation chunk reads at weight 0 (module docstring).
  """
  length = _check_int("length", length, 1)
  bos_id, eos_id, seed = _check_int("bos_id", bos_id, 1), _check_int("eos_id", eos_id, 1), _check_int("seed", seed, 0)
  context = _check_int("context", context, 0)
  if context >= length:
    raise ValueError(f"context must be smaller than length={length} (each chunk scores length - context pairs), "
                     f"got {context}")
  if bos_id == eos_id:
    raise ValueError(f"bos_id and eos_id must differ, got {bos_id} for both")
  if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence) or not documents:
    raise ValueError(f"documents must be a non-empty sequence of id sequences, got {type(documents).__name__}")
  sequences = []
  for i, ids in enumerate(documents):
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = (ids <= 0) | (ids == bos_id) | (ids == eos_id)
    if bad.any():
      raise ValueError(f"documents[{i}] holds id {int(ids[np.argmax(bad)])}: ids must be positive and not pad (0), "
                       f"bos_id ({bos_id}) or eos_id ({eos_id})")
    sequences.append(np.concatenate([[bos_id], ids, [eos_id]]))  # n + 1 pairs

  # Chunks (document, offset of the first pair in the row, pairs in the row, of which the first `read` are
  # context at weight 0), best-fit into rows in a seeded order.
  chunks = []
  for d, s in enumerate(sequences):
    scored = min(length, len(s) - 1)
    chunks.append((d, 0, scored, 0))
    for offset in range(scored, len(s) - 1, length - context):
      chunks.append((d, offset - context, context + min(length - context, len(s) - 1 - offset), context))
  order = np.random.default_rng(seed).permutation(len(chunks))
  free: list[tuple[int, int]] = []  # (room left, row), sorted
  placed = []  # (row, start, pairs, document, offset)
  used: list[int] = []  # pairs used per row
  for c in order:
    document, offset, pairs, read = chunks[c]
    slot = bisect.bisect_left(free, (pairs, -1))
    if slot < len(free):
      _, row = free.pop(slot)
    else:
      row = len(used)
      used.append(0)
    placed.append((row, used[row], pairs, document, offset, read))
    used[row] += pairs
    if used[row] < length:
      bisect.insort(free, (length - used[row], row))

  rows = len(used)
  inputs = np.zeros((rows, length), np.int32)
  targets = np.zeros((rows, length), np.int32)
  segment_ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  weights = np.zeros((rows, length), np.float32)
  placed = np.array(sorted(placed), dtype=np.int64).reshape(-1, 6)  # row-major, by start within a row
  segment_in_row = 0
  for k, (row, start, pairs, document, offset, read) in enumerate(placed):
    segment_in_row = 1 if k == 0 or placed[k - 1, 0] != row else segment_in_row + 1
    sequence, end = sequences[document], start + pairs
    inputs[row, start:end] = sequence[offset:offset + pairs]
    targets[row, start:end] = sequence[offset + 1:offset + pairs + 1]
    segment_ids[row, start:end] = segment_in_row
    positions[row, start:end] = np.arange(pairs)
    weights[row, start + read:end] = 1.0
  # The scored part of each chunk: (row, its start in the row, pairs, document, offset in the document)
  segments = np.stack([placed[:, 0], placed[:, 1] + placed[:, 5], placed[:, 2] - placed[:, 5], placed[:, 3],
                       placed[:, 4] + placed[:, 5]], axis=1) if len(placed) else placed[:, :5]
  return PackedText(inputs=inputs, targets=targets, weights=weights, segment_ids=segment_ids, positions=positions,
                    segments=segments)


class TextBatches:
  """Packed rows of one split's documents: deterministic training batches by step, exhaustive eval.

  Args:
    documents: token ids per document, without BOS / EOS (``tokenize_documents``).
    length: the row length (pairs per row).
    bos_id, eos_id: the ids framing every document.
    pack_seed: the order chunks are packed in (the rows are fixed for the life of the object, so a
      step maps to its batch in O(1)); ``train_batch``'s seed only orders the rows.
    context: pairs of a long document a continuation chunk reads before the ones it scores (evaluation's
      sliding window; ``pack_documents``).
    document_bytes: (optional) each document's UTF-8 bytes per token (``Tokenizer.token_bytes``): batches then
      hold ``target_bytes`` (``PackedText``), what bits per byte is counted in.
  """

  def __init__(self, documents: Sequence[Sequence[int]], *, length: int, bos_id: int = tokenizers.BOS_ID,
               eos_id: int = tokenizers.EOS_ID, pack_seed: int = 0, context: int = 0,
               document_bytes: Sequence[Sequence[int]] | None = None):
    packed = pack_documents(documents, length, bos_id=bos_id, eos_id=eos_id, seed=pack_seed, context=context)
    if document_bytes is not None:
      if len(document_bytes) != len(documents) or any(len(b) != len(d) for b, d in zip(document_bytes, documents)):
        raise ValueError("document_bytes must hold one count per token of each document")
      packed = packed.with_target_bytes(document_bytes)
    self._hold(packed)

  def _hold(self, packed: PackedText) -> None:
    self.packed = packed
    self.length = packed.inputs.shape[1]
    self._order = batching.EpochOrder(self.num_rows)

  @classmethod
  def from_texts(cls, texts: Sequence[str], tokenizer: tokenizers.Tokenizer, *, count_bytes: bool = False,
                 **kwargs) -> "TextBatches":
    """Tokenizes documents and packs them; ``kwargs`` as for the constructor, ids the tokenizer's;
    ``count_bytes``: with each token's UTF-8 bytes (``target_bytes``)."""
    document_bytes = [tokenizer.token_bytes(text) for text in texts] if count_bytes else None
    return cls(tokenize_documents(texts, tokenizer), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
               document_bytes=document_bytes, **kwargs)

  @property
  def num_rows(self) -> int:
    return self.packed.num_rows

  def first_rows(self, count: int) -> "TextBatches":
    """The same batches over the first ``count`` packed rows only (all of them if there are fewer): a
    fixed sample of the documents' chunks, in the seeded packing order."""
    count = _check_int("count", count, 1)
    if count >= self.num_rows:
      return self
    packed = self.packed
    rows = {name: getattr(packed, name)[:count] for name in packed.row_arrays}
    kept = dataclasses.replace(packed, segments=packed.segments[packed.segments[:, 0] < count], **rows)
    subset = copy.copy(self)
    subset._hold(kept)
    return subset

  def steps_per_epoch(self, batch_size: int) -> int:
    """Global batches per epoch: ``num_rows // batch_size``, at least 1 (``batching.epoch_order``)."""
    return batching.steps_per_epoch(self.num_rows, _check_int("batch_size", batch_size, 1))

  def train_batch(self, step: int, *, seed: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> dict[str, np.ndarray]:
    """This process's share of global batch ``step``: arrays [batch_size // process_count, length].

    A pure function of its arguments; process p takes rows [p * b, (p + 1) * b) of the global batch.
    """
    step, seed = _check_int("step", step, 0), _check_int("seed", seed, 0)
    batch_size = _check_int("batch_size", batch_size, 1)
    local = self._local_size(batch_size, process_index, process_count)
    rows = self._order.batch(step, seed, batch_size)
    return self.packed.arrays(rows[process_index * local:(process_index + 1) * local])

  def num_eval_batches(self, batch_size: int) -> int:
    """Global eval batches: ceil(num_rows / batch_size)."""
    return -(-self.num_rows // _check_int("batch_size", batch_size, 1))

  def eval_batches(self, batch_size: int, *, process_index: int = 0,
                   process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every row once, in order, at the fixed shape [batch_size // process_count, length]; the rows
    that fill the last batch are all padding (weights 0)."""
    local = self._local_size(_check_int("batch_size", batch_size, 1), process_index, process_count)
    for batch_number in range(self.num_eval_batches(batch_size)):
      start = batch_number * batch_size + process_index * local
      rows = np.arange(start, start + local)
      real = rows < self.num_rows
      batch = self.packed.arrays(np.where(real, rows, 0))
      yield {name: np.where(real[:, None], array, 0).astype(array.dtype) for name, array in batch.items()}

  @staticmethod
  def _local_size(batch_size: int, process_index, process_count) -> int:
    process_count = _check_int("process_count", process_count, 1)
    process_index = _check_int("process_index", process_index, 0)
    if process_index >= process_count:
      raise ValueError(f"process_index must be in [0, process_count={process_count}), got {process_index}")
    if batch_size % process_count:
      raise ValueError(f"batch_size={batch_size} (global) must be divisible by process_count={process_count}")
    return batch_size // process_count
