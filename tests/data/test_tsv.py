"""Parallel TSV corpora: good files read exactly, every malformed file is refused with file and line."""
import pytest

from xattn_jax.data import splits
from xattn_jax.data.tsv import CorpusFormatError, read_parallel_tsv


def write(tmp_path, data: bytes, name="corpus.tsv"):
  path = tmp_path / name
  path.write_bytes(data)
  return path


def test_reads_pairs_in_order_keeping_the_text_but_the_spaces_around_each_side(tmp_path):
  # spaces at a side's edges are invisible and were read as text: a trailing one made exact match 0
  path = write(tmp_path, "Nov 29, 2026\t29 nov. 2026\n 2  spaces  \t日本語 \u202f. \u3000\n".encode())
  assert read_parallel_tsv(path) == [("Nov 29, 2026", "29 nov. 2026"), ("2  spaces", "日本語 \u202f.")]


def test_crlf_bom_and_trailing_blank_lines_are_accepted(tmp_path):
  path = write(tmp_path, b"\xef\xbb\xbfa\tb\r\nc\td\r\n\r\n  \n\n")
  assert read_parallel_tsv(path) == [("a", "b"), ("c", "d")]


def test_a_byte_order_mark_inside_the_file_is_no_part_of_its_line(tmp_path):
  # two exports joined with `cat`: the second's mark began a source, an invisible character the model read
  path = write(tmp_path, b"\xef\xbb\xbfa\tb\r\n\xef\xbb\xbfc\td\r\n")
  assert read_parallel_tsv(path) == [("a", "b"), ("c", "d")]


def test_last_line_without_newline_is_read(tmp_path):
  assert read_parallel_tsv(write(tmp_path, b"a\tb\nc\td")) == [("a", "b"), ("c", "d")]


@pytest.mark.parametrize("data, line_number, problem", [
    (b"a\tb\nno tab here\nc\td\n", 2, "no tab"),
    (b"a\tb\nc\td\ne\tf\tg\n", 3, "2 tabs"),
    (b"\tb\n", 1, "empty source"),
    (b"a\tb\nc\t  \n", 2, "empty target"),
    (b"a\tb\n\nc\td\n", 2, "blank line"),
    (b"a\tb\nc\td\ncaf\xe9\tx\n", 3, "not valid UTF-8 at byte 4"),
])
def test_malformed_line_raises_with_file_and_line_number(tmp_path, data, line_number, problem):
  path = write(tmp_path, data)
  with pytest.raises(CorpusFormatError, match=problem) as caught:
    read_parallel_tsv(path)
  assert f"{path}:{line_number}: " in str(caught.value)
  assert caught.value.line_number == line_number


def test_every_malformed_line_is_reported_at_once(tmp_path):
  path = write(tmp_path, b"x\n" * 8 + b"a\tb\n")
  with pytest.raises(CorpusFormatError) as caught:
    read_parallel_tsv(path)
  assert [n for n, _ in caught.value.problems] == list(range(1, 9))
  assert "and 3 more malformed lines" in str(caught.value)


@pytest.mark.parametrize("data", [b"", b"\n\n", b"\r\n  \n"])
def test_empty_file_raises_naming_it(tmp_path, data):
  path = write(tmp_path, data)
  with pytest.raises(CorpusFormatError, match=f"{path}: the file is empty"):
    read_parallel_tsv(path)


def test_missing_file_and_directory_raise_corpus_errors(tmp_path):
  with pytest.raises(CorpusFormatError, match="missing.tsv: no such file"):
    read_parallel_tsv(tmp_path / "missing.tsv")
  with pytest.raises(CorpusFormatError, match="not a regular file"):
    read_parallel_tsv(tmp_path)


def test_corpus_error_is_a_value_error():
  assert issubclass(CorpusFormatError, ValueError)


def test_split_by_key_keeps_equal_keys_together_and_is_deterministic():
  items = [(f"sentence {i % 50}", f"target {i}") for i in range(400)]
  train, evaluation = splits.split_by_key(items, lambda pair: pair[0], seed=3, eval_fraction=0.2)
  assert sorted(train + evaluation) == sorted(items)
  assert not {s for s, _ in train} & {s for s, _ in evaluation}
  assert evaluation and (train, evaluation) == splits.split_by_key(items, lambda pair: pair[0], seed=3,
                                                                   eval_fraction=0.2)


def test_a_minimum_of_eval_keys_takes_the_lowest_hash_train_keys_and_leaves_one_to_train():
  """A 40-line file at eval_fraction 0.05 held out no line, and the LM run stopped asking for an eval file."""
  items = [f"line {i}" for i in range(40)] + ["line 0"]  # a repeated line keeps its side
  plain = splits.split_by_key(items, str, seed=0, eval_fraction=0.01)
  assert plain[1] == []  # the split this case is about
  train, evaluation = splits.split_by_key(items, str, seed=0, eval_fraction=0.01, min_eval_keys=2)
  assert len(set(evaluation)) == 2 and not set(train) & set(evaluation) and sorted(train + evaluation) == sorted(items)
  lowest = sorted(set(items), key=lambda key: splits.stable_unit_interval(key, 0))[:2]
  assert set(evaluation) == set(lowest) and train == [item for item in items if item not in lowest]
  wide = splits.split_by_key(items, str, seed=0, eval_fraction=0.5, min_eval_keys=2)
  assert wide == splits.split_by_key(items, str, seed=0, eval_fraction=0.5)  # enough already: the hash split
  assert splits.split_by_key(["a", "b"], str, min_eval_keys=5) in ((["a"], ["b"]), (["b"], ["a"]))  # one trains
  assert splits.split_by_key(["a", "a"], str, eval_fraction=0.01, min_eval_keys=1) == (["a", "a"], [])


@pytest.mark.parametrize("content, message", [
    ("a\tb\n".encode("utf-16"), "UTF-16"),
    (b"a\tb\rc\td\r", "carriage return"),
    ("a\tb\n".encode("utf-16-le"), "UTF-16 without a byte-order mark"),
])
def test_utf16_and_cr_only_files_are_named_for_what_they_are(tmp_path, content, message):
  path = tmp_path / "corpus.tsv"
  path.write_bytes(content)
  with pytest.raises(CorpusFormatError, match=message):
    read_parallel_tsv(path)


def test_a_split_far_below_its_fraction_is_told_apart_from_chance():
  """Keys from one side of a split by the same seed hash to the other side no more (a uniform draw of 400 keys
  at 0.05 holds out fewer than 5 by chance about once in 80,000)."""
  keys = [f"line {n}" for n in range(4000)]
  train, _ = splits.split_by_key(keys, str, seed=0, eval_fraction=0.05)
  _, again_eval = splits.split_by_key(train[:400], str, seed=0, eval_fraction=0.05)
  assert not again_eval and splits.far_below_fraction(len(again_eval), 400, 0.05)
  _, other_eval = splits.split_by_key(train[:400], str, seed=1, eval_fraction=0.05)
  assert not splits.far_below_fraction(len(other_eval), 400, 0.05)
  assert not splits.far_below_fraction(0, 300, 0.05)  # 15 expected: too few to tell
