"""The JSON records of a run's workdir, written whole and read back: config.json, data_files.json,
end_step.json, early_stop.json, a task's frozen.json / encoder.json, the rows of metrics.jsonl.

A damaged record (cut off by a kill in a version that wrote it in place, a hand edit gone wrong, an empty file)
is a DataError in one line naming the file, the line and column where it stops being JSON, and what the user
can do (launch.py: exit status 2), never a traceback; the file is never rewritten or removed here: it may be all
that is left of what it records. It imports only `errors`, so that every module of the engine and the tasks
reads through it.
"""
from __future__ import annotations

import contextlib
import json
import os

from xattn_jax.training.errors import DataError


def write_atomically(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file beside it: a process killed mid-write (or a full disk)
  leaves the file it replaces, never an empty or cut-off record that every later start would fail to read."""
  temporary = f"{path}.tmp"
  try:
    with open(temporary, "w") as f:
      f.write(text)
    os.replace(temporary, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    raise


def _damaged(path: str, line: int, column: int, why: str, remedy: str) -> DataError:
  return DataError(f"{path}:{line}:{column}: a damaged record ({why}), left as it is; {remedy}")


def _parsed(text: bytes, path: str, remedy: str, line: int = 1):
  """The JSON object in `text` (line `line` of `path`), or the DataError `read_record` describes."""
  try:
    value = json.loads(text)
  except UnicodeDecodeError as error:
    raise _damaged(path, line, error.start + 1, "not UTF-8", remedy) from None
  except json.JSONDecodeError as error:
    why = "empty" if not text.strip() else f"cut off or not JSON: {error.msg}"
    raise _damaged(path, line + error.lineno - 1, error.colno, why, remedy) from None
  if not isinstance(value, dict):
    raise _damaged(path, line, 1, f"a JSON {type(value).__name__}, not an object", remedy)
  return value


def read_record(path: str, remedy: str) -> dict | None:
  """The JSON object a run (or task) recorded in `path`, or None without the file. A damaged one (cut off by a
  kill in a version that wrote it in place, a hand edit gone wrong, empty) raises a DataError in one line naming
  `path`, the line and column where it stops being JSON, and `remedy`: what the user can do. The file is never
  rewritten or removed here: it may be all that is left of what it records."""
  try:
    with open(path, "rb") as f:
      text = f.read()
  except (FileNotFoundError, NotADirectoryError):  # none there
    return None
  return _parsed(text, path, remedy)


def read_config(workdir: str) -> dict | None:
  """The config the run in `workdir` recorded (its config.json, as nested dicts), or None without one."""
  return read_record(os.path.join(workdir, "config.json"), (
      f"{os.path.join(workdir, 'config.py')} holds the same config (its CONFIG string is config.json's "
      "contents): write that back as config.json, or restore config.json from a backup"))


def read_rows(path: str, remedy: str) -> list[dict]:
  """The rows of the JSON-lines record `path` ([] without it). A last line without its newline that is no JSON is
  one a kill cut off mid-write (each row is written whole with its newline): skipped. Any other damaged line
  raises a DataError as `read_record`'s, naming its line: a reader that rewrites the file would drop it."""
  try:
    with open(path, "rb") as f:
      lines = f.read().split(b"\n")
  except (FileNotFoundError, NotADirectoryError):  # none there
    return []
  rows = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rows.append(_parsed(line, path, remedy, number))
    except DataError:
      if number < len(lines):  # a whole line (its newline follows)
        raise
  return rows
