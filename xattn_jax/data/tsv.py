"""A user's parallel corpus: UTF-8 lines of ``source<TAB>target``, checked before training starts.

Decisions:
  * CRLF line endings are accepted (the ``\\r`` before ``\\n`` is removed), and so is a UTF-8 byte
    order mark at the start of the file (or of any line: two exports joined with `cat`): both are what
    spreadsheet exports on Windows write.
  * Blank lines at the end of the file are ignored; a blank line anywhere else is an error, since it
    usually means a line was split by accident.
  * A side that is empty or only whitespace is an error. Whitespace around a side is removed (spaces a
    spreadsheet or an editor left at a line's end are invisible, yet a model reads them as text: exact
    match against a reference with a trailing space was 0 where BLEU was 100); the rest is kept exactly.
  * Every malformed line is found in one pass; the error names the file, the first few 1-based line
    numbers and what is wrong with each, so a user can fix the file in one go.
"""
from __future__ import annotations

from xattn_jax.data import files


class CorpusFormatError(files.LineFileError):
  """A parallel corpus file is missing, empty, not UTF-8, or has malformed lines (see files.LineFileError)."""
  heading = "invalid parallel corpus (expected UTF-8 'source<TAB>target' lines)"
  bad_line = "malformed line"


def _line_problem(raw: bytes) -> tuple[str | None, tuple[str, str] | None]:
  """(description of what is wrong, None) or (None, (source, target)) for one line without its newline."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as error:
    return f"not valid UTF-8 at byte {error.start + 1} of the line ({raw[error.start:error.start + 4]!r})", None
  if not text.strip():
    return "blank line (blank lines are only allowed at the end of the file)", None
  tabs = text.count("\t")
  if tabs == 0:
    return "no tab: expected 'source<TAB>target'", None
  if tabs > 1:
    return f"{tabs} tabs: expected exactly one, between source and target", None
  source, target = text.split("\t")
  for side, value in (("source", source), ("target", target)):
    if not value.strip():
      return f"empty {side}", None
  return None, (source.strip(), target.strip())


def read_parallel_tsv(path) -> list[tuple[str, str]]:
  """Reads ``source<TAB>target`` lines into a list of (source, target) string pairs, in file order.

  Raises:
    CorpusFormatError (a ValueError): the file is missing, not a regular file, empty, or has a
      malformed line (not UTF-8, blank, no tab, more than one tab, an empty side); the message names
      the file and the 1-based line numbers.
  """
  lines = files.read_line_bytes(path, CorpusFormatError, "a TSV file")
  while lines and not lines[-1].strip():
    lines.pop()
  if not lines:
    raise CorpusFormatError(path, [(None, "the file is empty (no 'source<TAB>target' lines)")])

  pairs, problems = [], []
  for line_number, raw in enumerate(lines, start=1):
    problem, pair = _line_problem(raw)
    if problem is not None:
      problems.append((line_number, problem))
    else:
      pairs.append(pair)
  if problems:
    raise CorpusFormatError(path, problems)
  return pairs
