"""Reading a user's line-oriented UTF-8 file, with the checks every such reader shares."""
from __future__ import annotations

import os

_MAX_REPORTED_PROBLEMS = 5


class LineFileError(ValueError):
  """A user's line file is unreadable or has bad lines; subclasses name the format.

  Attributes:
    path: the file.
    line_number: 1-based number of the first bad line, or None for whole-file problems.
    problems: ``(line_number, description)`` for every problem found (the first five are shown).
  """
  heading = "invalid file"  # e.g. "invalid text file (expected UTF-8, one document per line)"
  bad_line = "bad line"  # what the "... and N more" summary calls a line

  def __init__(self, path, problems: list[tuple[int | None, str]]):
    self.path = os.fspath(path)
    self.problems = problems
    self.line_number = problems[0][0]
    shown = [f"{self.path}:{n}: {what}" if n is not None else f"{self.path}: {what}"
             for n, what in problems[:_MAX_REPORTED_PROBLEMS]]
    more = len(problems) - len(shown)
    if more:
      shown.append(f"... and {more} more {self.bad_line}{'s' if more > 1 else ''}")
    super().__init__(f"{self.heading}:\n  " + "\n  ".join(shown))


def read_line_bytes(path, error, kind: str) -> list[bytes]:
  """The lines of a UTF-8 file as bytes (`split_line_bytes`).

  `error(path, problems)` builds the reader's own exception from (line number or None, message) pairs;
  it is raised for a missing or non-regular file and for what `split_line_bytes` refuses.
  `kind` names the file in the message for a `path` that is no path ("a TSV file").
  """
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"path must be a str or os.PathLike naming {kind}, got {type(path).__name__} {path!r}")
  if not os.path.exists(path):
    raise error(path, [(None, "no such file")])
  if not os.path.isfile(path):
    raise error(path, [(None, "not a regular file")])
  with open(path, "rb") as f:
    return split_line_bytes(f.read(), path, error)


def split_line_bytes(data: bytes, name, error) -> list[bytes]:
  """The lines of UTF-8 text as bytes, without their line ends (\\n or \\r\\n) or a byte-order mark (at the
  start of any line: files joined with `cat` keep each one's, and str.strip leaves U+FEFF in the text); the
  last is b"" where the text ends with a line end.

  `error(name, problems)` is raised for a UTF-16 text (with a byte-order mark or without: NUL bytes), a line
  holding a NUL byte, and bare carriage returns (line ends, or inside a line).
  """
  if data.startswith((b"\xff\xfe", b"\xfe\xff")):
    raise error(name, [(None, "the file is UTF-16 (it starts with a UTF-16 byte-order mark); save it as UTF-8")])
  if b"\x00" in data:  # no UTF-8 text holds NUL; UTF-16 without a byte-order mark holds one in every other byte
    raise error(name, _nul_problems(data))
  if b"\r" in data and b"\n" not in data:
    raise error(name, [(None, "lines end with a bare carriage return (\\r, old Mac style); save it with \\n "
                              "line ends")])
  lines = [line.removesuffix(b"\r").removeprefix(b"\xef\xbb\xbf") for line in data.split(b"\n")]
  # A carriage return inside a line is an old Mac file's line end, in a file joined to others (three documents
  # were read as one); text has no other use for it.
  if bare := [number for number, line in enumerate(lines, start=1) if b"\r" in line]:
    raise error(name, [(number, "holds a carriage return (\\r) that ends no line: lines end at \\n or \\r\\n (part "
                                "of an old Mac file?); save it with \\n line ends") for number in bare])
  return lines


def _nul_problems(data: bytes) -> list[tuple[int | None, str]]:
  """The problems of a file that holds NUL bytes, which no UTF-8 text does: UTF-16 without a byte-order mark (it
  decodes as "UTF-8" with a NUL after every ASCII character, and trained as that), or the lines that hold one."""
  nuls = data.count(b"\x00")
  if nuls * 4 >= len(data):  # ASCII text in UTF-16 is half NULs
    return [(None, f"{nuls} of its {len(data)} bytes are NUL (\\x00): it is UTF-16 without a byte-order mark, most "
                   "likely; save it as UTF-8")]
  return [(number, f"holds a NUL byte (\\x00) at byte {line.index(0) + 1} of the line: binary data, or UTF-16; save "
                   "the file as UTF-8 text")
          for number, line in enumerate(data.split(b"\n"), start=1) if 0 in line]
