"""Inference I/O: input lines in, one answer per line out, errors as file:line."""
import io
import sys

import pytest

from xattn_jax.training import inference, task as task_lib, validation
from xattn_jax.training.errors import DataError, RunError


def test_input_lines_end_at_newlines_only_without_a_byte_order_mark(tmp_path):
  path = tmp_path / "inputs.txt"
  path.write_bytes("\ufeffabc\n\nhello\r\nxyz\u2028tail\n".encode())
  assert inference.read_input_lines(str(path)) == (str(path), ["abc", "", "hello", "xyz\u2028tail"])


def test_a_last_line_without_a_newline_is_read():
  sys_stdin = sys.stdin
  sys.stdin = io.TextIOWrapper(io.BytesIO(b"one\ntwo"))
  try:
    assert inference.read_input_lines("-") == ("<stdin>", ["one", "two"])
  finally:
    sys.stdin = sys_stdin


def test_reading_stdin_from_a_terminal_says_how_to_end_the_input(monkeypatch, capsys):
  """`launch.py --mode=infer` without piped input waited for the terminal without a word."""
  class Terminal(io.TextIOWrapper):
    def isatty(self):
      return True
  monkeypatch.setattr(sys, "stdin", Terminal(io.BytesIO(b"one\n")))
  assert inference.read_input_lines("-") == ("<stdin>", ["one"])
  assert "end them with Ctrl-D" in capsys.readouterr().err
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\n")))  # a pipe: nothing said
  inference.read_input_lines("-")
  assert capsys.readouterr().err == ""


def test_a_line_that_is_not_utf8_is_reported_as_file_and_line(tmp_path):
  path = tmp_path / "inputs.txt"
  path.write_bytes(b"abc\nab\xff\n")
  with pytest.raises(DataError, match=rf"^{path}:2: not valid UTF-8 at byte 3 of the line$"):
    inference.read_input_lines(str(path))


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_a_utf16_input_without_a_byte_order_mark_is_refused_not_answered_line_by_nul(tmp_path, encoding):
  """Read as UTF-8, two such lines were three of NUL-riddled text, answered with three lines and status 0."""
  path = tmp_path / "inputs.txt"
  path.write_bytes("the cat\nmy house\n".encode(encoding))
  with pytest.raises(DataError, match=rf"^{path}: .* NUL .*UTF-16 without a byte-order mark"):
    inference.read_input_lines(str(path))


def test_inputs_joined_with_cat_lose_each_byte_order_mark_as_data_files_do(tmp_path):
  path = tmp_path / "inputs.txt"
  path.write_bytes("\ufeffabc\r\n".encode() * 2)
  assert inference.read_input_lines(str(path)) == (str(path), ["abc", "abc"])


class Upper(task_lib.Task):
  """Answers each line in capitals; records what reached infer_lines."""

  def __init__(self):
    super().__init__(None)
    self.seen = []

  def infer_lines(self, model, lines):
    self.seen.append(lines)
    def read(index, line):
      if not line.isalpha():
        raise ValueError(f"{line!r} has a character outside a-z")
      return line.upper()
    return task_lib.read_each(lines, read)


def test_blank_lines_are_answered_blank_and_never_reach_the_task():
  """Task.infer, what the launcher and a notebook call: before, only the launcher answered blank lines and an
  empty list, and a notebook's task.infer(model, ['', 'x']) failed on the blank line."""
  task = Upper()
  assert task.infer(None, ["ab", "", "  ", "cd"]) == ["AB", "", "", "CD"]
  assert task.seen == [["ab", "cd"]]
  assert task.infer(None, ["", ""]) == ["", ""] and task.infer(None, []) == [] and len(task.seen) == 1
  assert task.infer(None, (line for line in ("ab",))) == ["AB"]  # any iterable of lines


def test_a_line_the_task_cannot_take_is_named_by_its_position_among_the_lines_given():
  with pytest.raises(task_lib.InputLineError, match=r"^input line 3: 'ab1' has a character outside a-z$"):
    Upper().infer(None, ["abc", "", "ab1"])  # index 1 of the non-blank lines


@pytest.mark.parametrize("lines, message", [("Dec 25, 1999", r"^lines: an iterable of input lines, got str "
                                                             r"\(one line is \[line\]\)$"),
                                            (["ab", 3], r"^lines\[1\]: a str, got int$"), (None, "got NoneType"),
                                            (["ab", "c\nd"], r"^lines\[1\]: holds a line break")])
def test_lines_that_are_not_strings_are_refused_naming_the_argument(lines, message):
  """A str was read as one line per character (12 'translations' of one date)."""
  with pytest.raises(ValueError, match=message):
    Upper().infer(None, lines)


def test_a_task_that_infers_blank_lines_is_handed_every_line(tmp_path):
  """A language model answers a blank line (a sample from nothing); the engine hands it over in place."""

  class Samples(task_lib.Task):
    infers_blank_lines = True

    def infer_lines(self, model, lines):
      return [line or f"sample {index}" for index, line in enumerate(lines)]

  trainer = type("FakeTrainer", (), {"task": Samples(None), "model": lambda self, state: None})()
  path = tmp_path / "lines.txt"
  path.write_text("ab\n\n\ncd\n")
  assert inference.infer(trainer, None, str(path), output=io.StringIO()) == ["ab", "sample 1", "sample 2", "cd"]
  assert not task_lib.Task.infers_blank_lines  # every other task: blank in, blank out (above)


def test_an_answer_holding_line_breaks_is_written_on_its_one_line(caplog):
  answers = inference.answer_lines(lambda lines: ["one\ntwo", "", "three\r\nfour", "five"], ["a", "", "b", "c"],
                                   "in.txt")
  assert answers == ["one two", "", "three  four", "five"]
  assert "in.txt: the answers to lines 1, 3 hold line breaks" in caplog.text


def test_a_line_the_task_cannot_take_is_reported_by_its_number_in_the_file():
  with pytest.raises(DataError, match=r"^inputs.txt:3: 'ab1' has a character outside a-z$"):
    inference.answer_lines(lambda lines: Upper().infer(None, lines), ["abc", "", "ab1"], "inputs.txt")


def test_a_huge_bad_line_is_named_in_one_short_line_that_keeps_its_ends():
  """A 5 MB line that named no file was echoed whole: a 5 MB error line."""
  line = "a" * 2_000_000 + "1" + "b" * 3_000_000
  with pytest.raises(DataError) as error:
    inference.answer_lines(lambda batch: Upper().infer(None, batch), [line], "in.txt")
  message = str(error.value)
  assert len(message) < 500 and "\n" not in message
  assert message.startswith("in.txt:1: 'aaa") and message.endswith("bbb' has a character outside a-z")
  assert "[4,999,681 characters left out]" in message


def test_every_line_the_task_cannot_take_is_named_at_once_by_its_number_in_the_file():
  """The first bad line alone stopped the run: a user mended an input one line a run."""
  lines = ["ab1", "", "cd", "e f", *[f"{k}" for k in range(12)]]
  with pytest.raises(task_lib.InputLineError) as error:
    Upper().infer(None, lines)
  assert [index for index, _ in error.value.problems] == [0, 3, *range(4, 16)]  # past the blank line
  with pytest.raises(DataError) as error:
    inference.answer_lines(lambda batch: Upper().infer(None, batch), lines, "in.txt")
  assert str(error.value).splitlines() == [
      "in.txt: 14 input lines the task cannot take:", "  in.txt:1: 'ab1' has a character outside a-z",
      "  in.txt:4: 'e f' has a character outside a-z",
      *(f"  in.txt:{5 + k}: '{k}' has a character outside a-z" for k in range(8)), "  ... and 4 more"]


def test_paths_in_an_input_file_are_read_relative_to_its_folder(tmp_path, monkeypatch):
  """As the paths of a pairs file are: feeding a file of image names next to the images failed from
  any other current directory."""

  class Paths(task_lib.Task):
    def infer_lines(self, model, lines):
      return [self.input_path(line) for line in lines]

  trainer = type("FakeTrainer", (), {"task": Paths(None), "model": lambda self, state: None})()
  (tmp_path / "inputs").mkdir()
  path = tmp_path / "inputs" / "lines.txt"
  path.write_text("img/a.png\n/abs/b.png\n")
  monkeypatch.chdir("/")
  answers = inference.infer(trainer, None, str(path), output=io.StringIO())
  assert answers == [str(tmp_path / "inputs" / "img" / "a.png"), "/abs/b.png"]
  sys_stdin = sys.stdin
  sys.stdin = io.TextIOWrapper(io.BytesIO(b"img/a.png\n"))
  try:  # stdin: the current directory
    assert inference.infer(trainer, None, "-", output=io.StringIO()) == ["img/a.png"]
  finally:
    sys.stdin = sys_stdin


def test_load_model_of_a_directory_that_is_no_run_says_so(tmp_path):
  with pytest.raises(RunError, match="holds no config.py"):
    inference.load_model(str(tmp_path))


def test_load_model_expands_a_workdir_under_home(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  with pytest.raises(RunError, match=f"^{tmp_path}/run holds no config.py"):
    inference.load_model("~/run")


def test_load_model_names_a_mode_it_cannot_load_in(tmp_path):
  with pytest.raises(ValueError, match="mode must be 'infer' or 'eval', got mode='train'"):
    inference.load_model(str(tmp_path), mode="train")


def test_load_model_takes_eval_overrides_and_refuses_a_model_change_or_an_unknown_field(trained_translator):
  model, task = inference.load_model(str(trained_translator), mode="eval",
                                     overrides={"task.decoding.method": "beam", "task.num_decode_examples": 8})
  assert task.config.task.decoding.method == "beam" and task.config.task.num_decode_examples == 8
  with pytest.raises(validation.ConfigError, match=r"^config\.data\.eval_fraction=0\.5: .* it chooses the held-out"):
    inference.load_model(str(trained_translator), mode="eval", overrides={"data.eval_fraction": 0.5})
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.model\.decoder\.mlp_dim=96: the run in .* was made with"):
    inference.load_model(str(trained_translator), mode="eval", overrides={"model.decoder.mlp_dim": 96})
  with pytest.raises(validation.ConfigError, match=r"^config\.data\.no_such_field=3: is not a field of the run"):
    inference.load_model(str(trained_translator), overrides={"data.no_such_field": 3})
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.max_length='abc': "):  # ml_collections' TypeError
    inference.load_model(str(trained_translator), overrides={"model.max_length": "abc"})


def test_the_batches_of_a_task_loaded_for_infer_are_refused_naming_the_mode_that_reads_them(trained_translator):
  """A task built for infer reads no data: its batches failed deep in the batching ('examples must be a non-empty
  sequence'), with no word of the mode."""
  _, task = inference.load_model(str(trained_translator))
  for call in (lambda: task.eval_batches(process_index=0, process_count=1),
               lambda: task.train_batch(0, process_index=0, process_count=1)):
    with pytest.raises(RunError, match=r"got mode='infer' .* loop\.load_model\(workdir, mode='eval'\)"):
      call()
