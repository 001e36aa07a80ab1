"""A user's image-caption pairs: UTF-8 lines of ``image_path<TAB>text``, checked before training starts.

Decisions (those of data.tsv, plus the image):
  * An image path is relative to the folder of the file that names it (an absolute path is kept, and `~` is the
    home folder, as in an infer line), so a folder of images and its pairs file can move together.
  * PNG and JPEG (anything Pillow opens) are read grey-scale (or RGB with ``grey=False``) in [0, 1], ink
    high, by data.image_files as every user's image is (EXIF orientation, deep images, transparency): a mostly
    light image (dark ink on paper) is inverted, so a photo of a written number looks like the bundled digits.
    It is resized (bilinear, aspect ratio kept) to fit inside the canvas: the largest size no larger than the
    canvas on either side.
  * Without an eval file, `held_out_pairs` holds out 5% of a pairs file's images, every pair of each, by a stable
    hash: the one split the pairs encoder, the LM on the captions and the VLM all read.
  * CRLF line ends and a UTF-8 byte-order mark are accepted; blank lines at the end are ignored, a blank
    line elsewhere is an error. A side that is empty or only whitespace is an error; the text is kept
    exactly otherwise.
  * Every bad line (not UTF-8, blank, no tab, more than one tab, an empty side, a missing or unreadable
    image) is found in one pass; the error (a files.LineFileError) names the file and each line.
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

import numpy as np

from xattn_jax.data import files, image_files, splits
from xattn_jax.data.vlm_digits import IMAGE_TOKEN, VLMExample


class ImageTextFormatError(files.LineFileError):
  """An image-caption file is missing, empty, not UTF-8, or has bad lines (see files.LineFileError)."""
  heading = "invalid image-caption file (expected UTF-8 'image_path<TAB>text' lines)"
  bad_line = "bad line"


def _check_canvas(canvas, caller: str) -> tuple[int, int]:
  if (len(canvas) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                              for v in canvas)):
    raise ValueError(f"{caller}: canvas must be (height, width) of positive ints, got {canvas!r}")
  return int(canvas[0]), int(canvas[1])


def fit_size(size: tuple[int, int], canvas: tuple[int, int]) -> tuple[int, int]:
  """The (height, width) of an image of size (h, w) scaled, aspect ratio kept, to the largest size that
  fits inside canvas (each side at least 1 pixel)."""
  (h, w), (height, width) = size, canvas
  factor = min(height / h, width / w)
  return (min(height, max(1, round(h * factor))), min(width, max(1, round(w * factor))))


def load_image(path: str, canvas: tuple[int, int], *, grey: bool = True) -> np.ndarray:
  """One image file -> float32 [h, w] (grey) or [h, w, 3] in [0, 1], ink high, fitted inside canvas.

  Decoded as `image_files.open_image` decodes every user's image (EXIF orientation applied, 16-bit / 32-bit /
  float images scaled from their own range, transparency laid on white); a mostly light image is inverted.

  Raises OSError (missing or not a file) or ValueError (not an image Pillow can read), saying which.
  """
  from PIL import Image  # Pillow only where a user's images are read

  canvas = _check_canvas(canvas, "load_image")
  image = image_files.open_image(path, grey=grey)
  height, width = fit_size((image.height, image.width), canvas)
  if (height, width) != (image.height, image.width):
    image = image.resize((width, height), Image.Resampling.BILINEAR)
  return image_files.ink_high(np.asarray(image, np.float32) / 255.0)


def read_images(paths: Sequence[str], canvas: tuple[int, int], *, grey: bool = True) -> list[np.ndarray]:
  """`load_image` of each path (for inference); the first bad one raises, naming it."""
  return [load_image(os.fspath(path), canvas, grey=grey) for path in paths]


def _line_problem(raw: bytes, folder: str) -> tuple[str | None, tuple[str, str] | None]:
  """(what is wrong, None) or (None, (image path, text)) for one line without its newline."""
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as error:
    return f"not valid UTF-8 at byte {error.start + 1} of the line ({raw[error.start:error.start + 4]!r})", None
  if not line.strip():
    return "blank line (blank lines are only allowed at the end of the file)", None
  tabs = line.count("\t")
  if tabs == 0:
    return "no tab: expected 'image_path<TAB>text'", None
  if tabs > 1:
    return f"{tabs} tabs: expected exactly one, between image path and text", None
  image_path, text = line.split("\t")
  for side, value in (("image path", image_path), ("text", text)):
    if not value.strip():
      return f"empty {side}", None
  if IMAGE_TOKEN in text:  # the LM would read it as an image's place (and never write it)
    return f"the text holds {IMAGE_TOKEN!r}, the language model's image marker: reword it", None
  return None, (os.path.join(folder, os.path.expanduser(image_path.strip())), text)


def _pair_lines(path) -> list[tuple[int, str | None, tuple[str, str] | None]]:
  """(1-based line number, what is wrong or None, (image path, text) or None) of each line of a pairs file,
  the trailing blank lines left out; a missing, unreadable or empty file raises ImageTextFormatError."""
  lines = files.read_line_bytes(path, ImageTextFormatError, "an image-caption file")
  while lines and not lines[-1].strip():
    lines.pop()
  if not lines:
    raise ImageTextFormatError(path, [(None, "the file is empty (no 'image_path<TAB>text' lines)")])
  folder = os.path.dirname(os.path.abspath(os.fspath(path)))
  return [(number, *_line_problem(raw, folder)) for number, raw in enumerate(lines, start=1)]


def read_image_text_pairs(path, *, canvas: tuple[int, int], grey: bool = True,
                          eval_side: bool | None = None) -> list[VLMExample]:
  """Reads ``image_path<TAB>text`` lines into examples of kind "user", in file order.

  Each example has one image (see `load_image`) and segments (("image", 0), ("target", text)). With `eval_side`
  True / False only the pairs on that side of `held_out_pairs` (`side_of_split`): the other side's images are not
  opened (an eval of the held-out 5% decoded every training image), its lines are still checked for form.

  Raises:
    ImageTextFormatError (a files.LineFileError, a ValueError): the file is missing, not a regular file,
      empty, or has a bad line (not UTF-8, blank, no tab, more than one tab, an empty side, a missing or
      unreadable image); the message names the file and the 1-based line numbers.
  """
  canvas = _check_canvas(canvas, "read_image_text_pairs")
  held = held_out_pairs(path) if eval_side is not None else frozenset()
  examples, problems, index = [], [], -1
  for line_number, problem, pair in _pair_lines(path):
    index += problem is None  # the pair's index among the well-formed lines, as held_out_pairs counts them
    if problem is None and eval_side is not None and (index in held) != eval_side:
      continue
    if problem is None:
      image_path, text = pair
      try:
        image = load_image(image_path, canvas, grey=grey)
      except (OSError, ValueError) as error:
        problem = str(error) + _missing_image_hint(image_path, path)
    if problem is not None:
      problems.append((line_number, problem))
      continue
    examples.append(VLMExample(images=(image,), segments=(("image", 0), ("target", text)), kind="user",
                               num_digits=0))
  if problems:
    raise ImageTextFormatError(path, problems)
  return examples


def _missing_image_hint(image_path: str, pairs_path) -> str:
  """Where a missing image's path, as written in the pairs file, names a file another way, the path to write: one
  from the current directory instead of the file's folder (`data/img/1.png` in data/pairs.tsv), or one with
  Windows' backslashes between folders (`img\\1.png`); else ""."""
  folder = os.path.dirname(os.path.abspath(os.fspath(pairs_path)))
  written = os.path.relpath(image_path, folder)
  if os.path.exists(image_path):
    return ""
  if os.path.isfile(written):
    return (f" (paths are relative to the pairs file's folder, {folder}; {written!r} is a file from the current "
            f"directory: write it as {os.path.relpath(os.path.abspath(written), folder)!r})")
  forward = written.replace("\\", "/")
  if forward != written and os.path.isfile(os.path.join(folder, forward)):
    return f" (write {forward!r}: folders are separated by '/', not '\\')"
  return ""


def read_image_text_pairs_cached(path, *, canvas: tuple[int, int], grey: bool = True,
                                 eval_side: bool | None = None) -> list[VLMExample]:
  """`read_image_text_pairs`, read once per (file, modification time, canvas, grey, side): a task's validation and
  the task itself read the same file. Raises what it raises."""
  path = os.path.abspath(os.fspath(path))
  mtime_ns = os.stat(path).st_mtime_ns if os.path.exists(path) else None
  return _read_cached(path, mtime_ns, _check_canvas(canvas, "read_image_text_pairs_cached"), grey, eval_side)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, mtime_ns, canvas: tuple[int, int], grey: bool, eval_side: bool | None) -> list[VLMExample]:
  del mtime_ns  # part of the cache key: an edited file is read again
  return read_image_text_pairs(path, canvas=canvas, grey=grey, eval_side=eval_side)


# Without an eval file, this share of a pairs file's distinct images (every pair of each) is held out for eval.
PAIRS_EVAL_FRACTION = 0.05


def held_out_pairs(path) -> frozenset[int]:
  """`_held_out_pairs` of the file, computed once per file version (validation, each side of each task ask)."""
  path = os.path.abspath(os.fspath(path))
  return _held_out_pairs(path, os.stat(path).st_mtime_ns if os.path.exists(path) else None)


@functools.lru_cache(maxsize=4)
def _held_out_pairs(path: str, mtime_ns) -> frozenset[int]:
  """The file-order indices of the pairs held out for eval where no eval file is named: those of
  PAIRS_EVAL_FRACTION of the file's distinct images, by a stable hash of the image path relative to the file's
  folder (the split survives moving the folder), every pair of a held-out image with them, at least one image
  where the file has two. The pairs encoder, the LM on the captions and the VLM all hold out these, so none of
  them trains on a held-out image or its captions. Lines with problems are left to the readers to report."""
  del mtime_ns  # part of the cache key: an edited file is split again
  folder = os.path.dirname(path)
  images = [(index, os.path.relpath(pair[0], folder))
            for index, (_, _, pair) in enumerate(line for line in _pair_lines(path) if line[1] is None)]
  _, held = splits.split_by_key(images, lambda item: item[1], seed=0, eval_fraction=PAIRS_EVAL_FRACTION,
                                min_eval_keys=1)
  return frozenset(index for index, _ in held)


def side_of_split(items: Sequence, path, *, eval_side: bool) -> list:
  """The items of a pairs file's pairs (one per pair, in file order) on one side of `held_out_pairs`."""
  held = held_out_pairs(path)
  return [item for index, item in enumerate(items) if (index in held) == eval_side]


def pair_line_numbers(path) -> list[int]:
  """The 1-based line number of each well-formed ``image_path<TAB>text`` line, in file order: the lines the
  examples of `read_image_text_pairs` come from."""
  return [number for number, problem, _ in _pair_lines(path) if problem is None]


def read_pair_images(path) -> list[str]:
  """The image path of each well-formed ``image_path<TAB>text`` line (resolved, symlinks too), images not opened."""
  return [os.path.realpath(pair[0]) for _, problem, pair in _pair_lines(path) if problem is None]


def read_pair_texts(path) -> list[str]:
  """The text side of each ``image_path<TAB>text`` line, in file order, the images not opened: what a
  language model pretrains on before it reads the images (the VLM task's LM for a user's pairs).

  Raises ImageTextFormatError for the file and line problems `read_image_text_pairs` names, except a
  missing or unreadable image.
  """
  texts, problems = [], []
  for line_number, problem, pair in _pair_lines(path):
    if problem is None:
      texts.append(pair[1])
    else:
      problems.append((line_number, problem))
  if problems:
    raise ImageTextFormatError(path, problems)
  return texts
