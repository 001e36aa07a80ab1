"""Text for causal language models: reading one document per line, and packing next-token rows."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from xattn_jax.data import text, tokenizers

BOS, EOS = tokenizers.BOS_ID, tokenizers.EOS_ID

documents_strategy = st.lists(st.lists(st.integers(3, 50), max_size=20), min_size=1, max_size=12)


def _documents(seed, count=30, longest=25):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 100, rng.integers(0, longest)).tolist() for _ in range(count)]


def _pairs(document):
  sequence = [BOS] + list(document) + [EOS]
  return list(zip(sequence[:-1], sequence[1:]))


# --- reading -----------------------------------------------------------------------------------------

def test_read_documents_keeps_each_non_blank_line_exactly(tmp_path):
  path = tmp_path / "docs.txt"
  path.write_bytes(b"\xef\xbb\xbffirst  line \r\n\n   \nsecond\tline\n\xc3\xa9t\xc3\xa9\n\n")
  assert text.read_documents(path) == ["first  line ", "second\tline", "été"]


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
  path = tmp_path / "docs.txt"
  path.write_bytes(b"fine\nlatin-1 \xe9t\xe9\nfine\n\xff\n")
  with pytest.raises(text.TextFormatError, match=rf"{path}:2: not valid UTF-8 .*\n.*{path}:4: not valid") as error:
    text.read_documents(path)
  assert error.value.line_number == 2 and isinstance(error.value, ValueError)


@pytest.mark.parametrize("content, message", [(b"", "no document"), (b"\n  \n\r\n", "no document"),
                                              (b"\xff\xfeh\x00i\x00", "UTF-16"), (b"one\rtwo\r", "carriage return")])
def test_a_file_without_documents_is_an_error_naming_it(tmp_path, content, message):
  path = tmp_path / "docs.txt"
  path.write_bytes(content)
  with pytest.raises(text.TextFormatError, match=rf"{path}: .*{message}"):
    text.read_documents(path)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_without_a_byte_order_mark_is_refused_not_read_as_nul_riddled_text(tmp_path, encoding):
  path = tmp_path / "docs.txt"
  path.write_bytes("first document\nsecond one\n".encode(encoding))
  with pytest.raises(text.TextFormatError, match=rf"{path}: .* NUL .*UTF-16 without a byte-order mark"):
    text.read_documents(path)


@pytest.mark.parametrize("data, problem", [
    (b"a long enough first document\nbinary \x00 here\nfine\n", "2: holds a NUL byte .* at byte 8 "),
    # an old Mac file joined to a Unix one: its three documents were read as one, \\r and all
    (b"first\rsecond\rthird\r\nfourth\r\nfifth\n", "1: holds a carriage return .* that ends no line")])
def test_a_line_holding_a_nul_byte_or_a_carriage_return_inside_is_named_by_file_and_line(tmp_path, data, problem):
  path = tmp_path / "docs.txt"
  path.write_bytes(data)
  with pytest.raises(text.TextFormatError, match=rf"{path}:{problem}") as error:
    text.read_documents(path)
  assert len(error.value.problems) == 1


def test_a_missing_file_is_an_error_naming_it(tmp_path):
  with pytest.raises(text.TextFormatError, match=rf"{tmp_path / 'none.txt'}: no such file"):
    text.read_documents(tmp_path / "none.txt")


# --- packing -----------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(documents=documents_strategy, length=st.integers(1, 16), seed=st.integers(0, 3), context=st.integers(0, 15))
def test_packing_holds_every_pair_of_every_document_exactly_once(documents, length, seed, context):
  """With a context, too: each pair is scored once, each scored chunk after a document's first reads the
  `context` pairs before it (weight 0) in the same segment, positions from 0 at the context's start."""
  context %= length
  packed = text.pack_documents(documents, length, seed=seed, context=context)
  rebuilt = {d: [] for d in range(len(documents))}
  scored = np.zeros_like(packed.weights)
  for row, start, pairs, document, offset in sorted(packed.segments.tolist(), key=lambda s: (s[3], s[4])):
    assert offset == len(rebuilt[document])  # chunks of a document follow on without gaps or overlaps
    rebuilt[document] += list(zip(packed.inputs[row, start:start + pairs], packed.targets[row, start:start + pairs]))
    scored[row, start:start + pairs] = 1
    read = context if offset else 0  # the pairs the chunk reads first
    before = slice(start - read, start)
    assert list(zip(packed.inputs[row, before], packed.targets[row, before])) == \
        _pairs(documents[document])[offset - read:offset]
    segment = packed.segment_ids[row, start]
    assert (packed.segment_ids[row, start - read:start + pairs] == segment).all()
    assert packed.positions[row, start - read] == 0 and (start - read == 0 or
                                                          packed.segment_ids[row, start - read - 1] != segment)
  assert all(rebuilt[d] == _pairs(document) for d, document in enumerate(documents))
  np.testing.assert_array_equal(packed.weights, scored)  # nothing else carries weight
  assert packed.weights.sum() == sum(len(d) + 1 for d in documents)


@settings(max_examples=40, deadline=None)
@given(documents=documents_strategy, length=st.integers(1, 16), context=st.integers(0, 15))
def test_target_bytes_sit_on_the_scored_pairs_of_their_targets_and_sum_to_the_texts_bytes(documents, length,
                                                                                          context):
  """Here a token's byte count is a function of its id (id % 5: 0 for a span-less mark) and EOS counts 1: every
  scored pair carries its target's count, every other position 0, in the batches and in first_rows too."""
  context %= length
  batches = text.TextBatches(documents, length=length, context=context,
                             document_bytes=[[i % 5 for i in d] for d in documents])
  packed = batches.packed
  expected = np.where(packed.targets == EOS, 1, packed.targets % 5) * packed.weights
  np.testing.assert_array_equal(packed.target_bytes, expected)
  assert packed.target_bytes.sum() == sum(i % 5 for d in documents for i in d) + len(documents)
  batch = next(batches.first_rows(1).eval_batches(2))
  np.testing.assert_array_equal(batch["target_bytes"][0], expected[0])
  assert (batch["target_bytes"][1:] == 0).all() and "target_bytes" not in text.TextBatches(
      documents, length=length).train_batch(0, seed=0, batch_size=1)
  with pytest.raises(ValueError, match="one count per token"):
    text.TextBatches(documents, length=length, document_bytes=[d[:-1] or [0, 0] for d in documents])


@settings(max_examples=40, deadline=None)
@given(documents=documents_strategy, length=st.integers(1, 16))
def test_positions_restart_at_zero_in_every_segment(documents, length):
  packed = text.pack_documents(documents, length)
  starts_segment = np.diff(packed.segment_ids, axis=1, prepend=0) != 0
  real = packed.segment_ids > 0
  assert (packed.positions[real & starts_segment] == 0).all()
  following = real & ~starts_segment
  previous = np.concatenate([np.zeros_like(packed.positions[:, :1]), packed.positions[:, :-1]], axis=1)
  assert (packed.positions[following] == previous[following] + 1).all()
  assert (packed.positions[~real] == 0).all() and (packed.weights[~real] == 0).all()


def test_targets_never_cross_a_document_boundary():
  """Within a segment each input is the previous target; a segment ends at EOS or at the row's
  chunk size, never by reading into the next document."""
  documents = _documents(0)
  packed = text.pack_documents(documents, 16)
  assert (packed.segment_ids.max(axis=1) > 1).any(), "rows should hold several documents"
  for row, start, pairs, document, offset in packed.segments.tolist():
    inputs, targets = packed.inputs[row, start:start + pairs], packed.targets[row, start:start + pairs]
    np.testing.assert_array_equal(inputs[1:], targets[:-1])
    assert list(zip(inputs, targets)) == _pairs(documents[document])[offset:offset + pairs]
  is_eos = packed.targets == EOS
  assert is_eos.sum() == len(documents)
  assert (packed.segment_ids[is_eos] > 0).all()


def test_segment_ids_number_the_segments_of_a_row_from_one():
  packed = text.pack_documents(_documents(1), 12)
  for row in range(packed.num_rows):
    ids = packed.segment_ids[row][packed.segment_ids[row] > 0]
    assert ids[0] == 1 and set(np.diff(ids)) <= {0, 1}


def test_a_document_longer_than_a_row_is_split_into_chunks_of_row_length():
  packed = text.pack_documents([list(range(3, 40)), [5, 6]], 10)  # 38 pairs -> 10, 10, 10, 8
  chunks = sorted((offset, pairs) for _, _, pairs, document, offset in packed.segments.tolist() if document == 0)
  assert chunks == [(0, 10), (10, 10), (20, 10), (30, 8)]
  assert packed.inputs.shape[1] == 10


def test_a_sliding_window_scores_length_then_length_minus_context_pairs_a_chunk():
  packed = text.pack_documents([list(range(3, 40)), [5, 6]], 10, context=4)  # 38 pairs -> 10, then 6 each
  chunks = sorted((offset, pairs) for _, _, pairs, document, offset in packed.segments.tolist() if document == 0)
  assert chunks == [(0, 10), (10, 6), (16, 6), (22, 6), (28, 6), (34, 4)]


def test_packing_is_deterministic_given_the_seed():
  documents = _documents(2)
  first, again, other = (text.pack_documents(documents, 16, seed=s) for s in (0, 0, 1))
  np.testing.assert_array_equal(first.inputs, again.inputs)
  np.testing.assert_array_equal(first.segments, again.segments)
  assert not np.array_equal(first.segments, other.segments)


def test_best_fit_leaves_little_room_in_rows():
  packed = text.pack_documents(_documents(3, count=200, longest=12), 32)
  assert packed.weights.mean() > 0.9


@pytest.mark.parametrize("kwargs, message", [
    (dict(documents=[[3, 0, 4]]), r"documents\[0\] holds id 0"),
    (dict(documents=[[3], [EOS]]), r"documents\[1\] holds id 2"),
    (dict(documents=[]), "documents must be a non-empty"),
    (dict(length=0), "length must be an integer >= 1"),
    (dict(bos_id=5, eos_id=5), "bos_id and eos_id must differ"),
    (dict(context=4), "context must be smaller than length=4"),
    (dict(context=-1), "context must be an integer >= 0"),
])
def test_bad_packing_arguments_raise_naming_them(kwargs, message):
  args = dict(documents=[[3, 4]], length=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    text.pack_documents(args.pop("documents"), args.pop("length"), **args)


# --- batches -----------------------------------------------------------------------------------------

def test_train_batch_is_a_pure_function_of_the_step_and_processes_split_it():
  batches = text.TextBatches(_documents(4, count=100), length=16)
  again = text.TextBatches(_documents(4, count=100), length=16)
  whole = batches.train_batch(7, seed=3, batch_size=4)
  np.testing.assert_array_equal(whole["inputs"], again.train_batch(7, seed=3, batch_size=4)["inputs"])
  halves = [batches.train_batch(7, seed=3, batch_size=4, process_index=p, process_count=2) for p in (0, 1)]
  for name in whole:
    np.testing.assert_array_equal(np.concatenate([h[name] for h in halves]), whole[name])
  assert set(whole) == {"inputs", "targets", "weights", "segment_ids", "positions"}


def test_an_epoch_of_train_batches_takes_each_row_at_most_once():
  batches = text.TextBatches(_documents(5, count=100), length=16)
  steps = batches.steps_per_epoch(3)
  seen = np.concatenate([batches.train_batch(s, seed=0, batch_size=3)["inputs"] for s in range(steps)])
  assert len({row.tobytes() for row in seen}) == len(seen) == steps * 3


def test_rows_fewer_than_a_batch_fill_it_by_repeating_every_row():
  batches = text.TextBatches(_documents(5, count=6), length=16)
  assert batches.num_rows < 8 and batches.steps_per_epoch(8) == 1
  inputs = batches.train_batch(2, seed=0, batch_size=8)["inputs"]
  assert inputs.shape == (8, 16)
  assert len({row.tobytes() for row in inputs}) == batches.num_rows


def test_eval_batches_yield_every_row_once_then_padding():
  batches = text.TextBatches.from_texts(["one two", "three", "four five six"] * 5, tokenizers.ByteTokenizer(),
                                        length=8)
  rows = np.concatenate([b["inputs"] for b in batches.eval_batches(4)])
  weights = np.concatenate([b["weights"] for b in batches.eval_batches(4)])
  np.testing.assert_array_equal(rows[:batches.num_rows], batches.packed.inputs)
  assert len(rows) == 4 * batches.num_eval_batches(4) and (weights[batches.num_rows:] == 0).all()
  assert (rows[batches.num_rows:] == 0).all()


def test_the_first_rows_are_those_rows_of_the_packing_and_nothing_else():
  batches = text.TextBatches.from_texts([f"document {n} " * (n % 5 + 1) for n in range(60)], tokenizers.ByteTokenizer(),
                                        length=16)
  assert batches.num_rows > 10
  first = batches.first_rows(10)
  assert first.num_rows == 10 and batches.first_rows(10_000) is batches
  rows = np.concatenate([b["inputs"] for b in first.eval_batches(4)])
  np.testing.assert_array_equal(rows[:10], batches.packed.inputs[:10])
  assert (rows[10:] == 0).all() and (first.packed.segments[:, 0] < 10).all()
  assert len(first.packed.segments) == (batches.packed.segments[:, 0] < 10).sum()

