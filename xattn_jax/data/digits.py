"""scikit-learn's bundled handwritten digits: a fixed split, normalised pixels, deterministic batches.

The 1,797 grey-scale 8x8 images of `sklearn.datasets.load_digits` ship inside scikit-learn, so nothing is
downloaded. Pixels there are integers 0..16, ink high. This module

- splits them once into train / validation / test, stratified by class, with a fixed seed (`load_digits_split`):
  runs evaluate on validation while they train (what a best checkpoint, early stopping or any choice of settings
  reads) and are scored on test once at the end;
- scales pixels to [0, 1] and standardises them with the training set's mean and standard deviation (one
  scalar each, so a resized image keeps the same statistics);
- optionally resizes images to another grid (`resize_images`, bilinear with half-pixel centres), e.g. to
  evaluate a reader on 16x16 = 256 features after training on 64;
- serves batches as pure functions of (seed, step, process_index, process_count) (`train_batch`), so the step
  is the position in the data stream and a resumed run sees exactly the batches an uninterrupted one would,
  and an eval split exactly once in padded batches with weights (`eval_batches`).

Host-side numpy only: images come out as float32 `[batch, height, width, 1]`, labels as int32 `[batch]`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Iterator

import numpy as np

from xattn_jax.data import image_files, splits

EVAL_SPLITS = splits.EVAL_SPLITS  # what a run may evaluate on (data.eval_split)
SPLITS = ("train", *EVAL_SPLITS)
VALIDATION_FRACTION = 0.1  # of each class's non-test images, held out for validation
NUM_CLASSES = 10
NUM_IMAGES = 1797  # in load_digits
NATIVE_GRID = (8, 8)
# The largest train_batch max_shift that cannot move any digit entirely off the canvas: a diagonal shift
# by 4 pixels already clears some (`largest_safe_shift` of all 1,797 images, whichever split; the tests
# check it against the data).
MAX_SHIFT = 3
_RAW_MAX = 16.0  # load_digits pixels are integers 0..16


@dataclasses.dataclass(frozen=True)
class DigitsSplit:
  """The digits, split once. Images are in [0, 1] (not yet standardised), `[n, 8, 8]` float32."""
  train_images: np.ndarray  # [n_train, 8, 8]
  train_labels: np.ndarray  # [n_train] int32
  validation_images: np.ndarray  # [n_validation, 8, 8]
  validation_labels: np.ndarray  # [n_validation] int32
  test_images: np.ndarray  # [n_test, 8, 8]
  test_labels: np.ndarray  # [n_test] int32
  mean: float  # pixel mean of the training images, in [0, 1] units
  std: float  # pixel standard deviation of the training images

  def side(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of one of SPLITS."""
    if name not in SPLITS:
      raise ValueError(f"DigitsSplit.side: name must be one of {SPLITS}, got {name!r}")
    return getattr(self, f"{name}_images"), getattr(self, f"{name}_labels")

  def standardize(self, images: np.ndarray) -> np.ndarray:
    """(images - mean) / std with the training statistics; images in [0, 1] units."""
    return ((images - self.mean) / self.std).astype(np.float32)


def load_digits_split(*, test_fraction: float = 0.2, split_seed: int = 0,
                      validation_fraction: float = VALIDATION_FRACTION) -> DigitsSplit:
  """Stratified train / validation / test split of the bundled digits (default 1,288 / 149 / 360 images).

  Test: scikit-learn's stratified `train_test_split` at test_fraction (360 images by default). Validation: of
  each class's other images, the ceil(validation_fraction * n) of lowest stable hash of their place there
  (`splits.stable_unit_interval`, seeded by split_seed); train: the rest, in their order. The split depends only
  on (test_fraction, split_seed, validation_fraction), and validation_fraction never moves a test image.
  The standardisation statistics are the train side's.
  """
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"load_digits_split: test_fraction must be in (0, 1), got {test_fraction}")
  if not 0.0 <= validation_fraction < 1.0:
    raise ValueError(f"load_digits_split: validation_fraction must be in [0, 1), got {validation_fraction}")
  from sklearn.datasets import load_digits  # imported here: sklearn is slow to import and only data needs it
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  images = (digits.images / _RAW_MAX).astype(np.float32)  # [1797, 8, 8]
  labels = digits.target.astype(np.int32)
  rest_x, test_x, rest_y, test_y = train_test_split(
      images, labels, test_size=test_fraction, stratify=labels, random_state=split_seed)
  held = np.zeros(len(rest_y), bool)
  for c in range(NUM_CLASSES):
    members = np.flatnonzero(rest_y == c)
    ranked = sorted(members, key=lambda i: splits.stable_unit_interval(f"digit {i}", split_seed))
    held[ranked[:num_validation_images(len(members), validation_fraction)]] = True
  train_x, train_y = rest_x[~held], rest_y[~held]
  return DigitsSplit(train_images=train_x, train_labels=train_y, validation_images=rest_x[held],
                     validation_labels=rest_y[held], test_images=test_x, test_labels=test_y,
                     mean=float(train_x.mean()) if len(train_x) else 0.0,
                     std=float(train_x.std()) if len(train_x) else 1.0)


def split_settings(data_config) -> tuple[float, str]:
  """(validation_fraction, eval_split) of a run's data config. A config written before the validation split
  existed has neither field: its run trained on every non-test image and evaluated on test (0.0, "test")."""
  return data_config.get("validation_fraction", 0.0), data_config.get("eval_split", "test")


def num_validation_images(class_images: int, validation_fraction: float) -> int:
  """How many of a class's `class_images` non-test images go to validation: ceil(fraction * n), in floating
  point as numpy computes it (so 0.1 of 40 is 4, not 5)."""
  return int(np.ceil(validation_fraction * class_images))


def class_counts(*, test_fraction: float = 0.2, split_seed: int = 0,
                 validation_fraction: float = VALIDATION_FRACTION) -> dict[str, np.ndarray]:
  """{split: images of each class [NUM_CLASSES]} of that load_digits_split, for config checks."""
  split = load_digits_split(test_fraction=test_fraction, split_seed=split_seed,
                            validation_fraction=validation_fraction)
  return {name: np.bincount(split.side(name)[1], minlength=NUM_CLASSES) for name in SPLITS}


def num_test_images(test_fraction: float) -> int:
  """len(load_digits_split(test_fraction=...).test_labels), without loading the data: scikit-learn's
  train_test_split takes ceil(test_fraction * n) test examples."""
  return math.ceil(test_fraction * NUM_IMAGES)


def _linear_resize_matrix(old: int, new: int, antialias: bool = False) -> np.ndarray:
  """[new, old] weights of 1D linear interpolation with half-pixel centres (as jax.image.resize); shrinking with
  `antialias`, the triangle filter widened by old / new (as jax.image.resize's antialias), so that every input
  pixel counts and a stroke thinner than the new pixels is kept, fainter, rather than dropped between samples."""
  centres = (np.arange(new) + 0.5) * old / new - 0.5  # output pixel centres in input coordinates
  if antialias and new < old:
    weights = np.maximum(0.0, 1.0 - np.abs(np.arange(old)[None, :] - centres[:, None]) * new / old)
    return weights / weights.sum(axis=1, keepdims=True)
  centres = np.clip(centres, 0.0, old - 1)
  lower = np.floor(centres).astype(int)
  upper = np.minimum(lower + 1, old - 1)
  frac = centres - lower
  weights = np.zeros((new, old), np.float64)
  weights[np.arange(new), lower] += 1.0 - frac
  weights[np.arange(new), upper] += frac
  return weights


def resize_images(images: np.ndarray, grid: tuple[int, int], *, antialias: bool = False) -> np.ndarray:
  """Bilinear resize of images `[n, height, width]` to `[n, grid[0], grid[1]]` (float32).

  Each output pixel is a convex combination of input pixels, so standardising before or after resizing gives
  the same result, and the unchanged grid returns the images exactly. Shrinking, `antialias` reads every input
  pixel (`_linear_resize_matrix`): what a user's picture, many times the grid, needs; the data set's own images
  (the resolution evals) are resized without it.
  """
  images = np.asarray(images)
  if images.ndim != 3:
    raise ValueError(f"resize_images: images must be [n, height, width], got shape {list(images.shape)}")
  if len(grid) != 2 or min(grid) < 1:
    raise ValueError(f"resize_images: grid must be (height, width) of positive ints, got {grid}")
  height, width = images.shape[1:]
  if (height, width) == tuple(grid):
    return images.astype(np.float32)
  rows = _linear_resize_matrix(height, grid[0], antialias)  # [h2, h]
  cols = _linear_resize_matrix(width, grid[1], antialias)  # [w2, w]
  return (rows @ images @ cols.T).astype(np.float32)  # two products: one three-operand einsum took seconds


def _check_process(batch_size: int, process_index: int, process_count: int) -> int:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"digits: need 0 <= process_index < process_count, got process_index={process_index}, "
                     f"process_count={process_count}")
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(f"digits: batch_size must be a positive multiple of process_count={process_count}, "
                     f"got batch_size={batch_size}")
  return batch_size // process_count


def _shift_images(images: np.ndarray, shifts: np.ndarray) -> np.ndarray:
  """Translate each image `[n, h, w]` by integer (row, col) `shifts [n, 2]`, filling with background 0."""
  n, h, w = images.shape
  max_shift = int(np.abs(shifts).max(initial=0))
  padded = np.pad(images, ((0, 0), (max_shift, max_shift), (max_shift, max_shift)))
  out = np.empty_like(images)
  for i, (dr, dc) in enumerate(shifts):
    out[i] = padded[i, max_shift - dr: max_shift - dr + h, max_shift - dc: max_shift - dc + w]
  return out


def largest_safe_shift(images: np.ndarray) -> int:
  """The largest s such that `_shift_images` by any offset in [-s, s] per axis leaves ink (a pixel > 0) in
  every image `[n, h, w]`.

  A shift by (dr, dc) keeps the source rows [0, h - dr) when dr >= 0, else [-dr, h), and the columns alike:
  a longer shift keeps less, so the four corners (+-s, +-s) are the shifts that decide.
  """
  ink = np.asarray(images) > 0
  height, width = ink.shape[1:]
  for shift in range(1, min(height, width)):
    for rows in (slice(0, height - shift), slice(shift, height)):
      for columns in (slice(0, width - shift), slice(shift, width)):
        if not ink[:, rows, columns].any(axis=(1, 2)).all():
          return shift - 1
  return min(height, width) - 1


def train_batch(split: DigitsSplit, step: int, *, seed: int, batch_size: int, process_index: int = 0,
                process_count: int = 1, grid: tuple[int, int] | None = None,
                max_shift: int = 0) -> dict[str, np.ndarray]:
  """This process's slice of global training batch number `step`: a pure function of its arguments.

  The global stream walks through a fresh seeded permutation of the training set every epoch: example number
  `step * batch_size + j` is `permutation(seed, epoch)[position in epoch]`. Each of the `process_count`
  processes takes its own contiguous `batch_size / process_count` rows of the global batch.
  `max_shift` > 0 translates each image by a random integer offset in [-max_shift, max_shift] per axis
  (drawn from (seed, step, row), so augmentation is as deterministic as the order). The shift moves the native
  8x8 images, before any resize to `grid`; up to MAX_SHIFT it never moves a digit entirely off the canvas.

  Returns `images` float32 `[batch_size / process_count, height, width, 1]` (standardised, resized to
  `grid` when given) and `labels` int32 `[batch_size / process_count]`.
  """
  if step < 0:
    raise ValueError(f"train_batch: step must be >= 0, got {step}")
  local = _check_process(batch_size, process_index, process_count)
  num_train = len(split.train_labels)
  positions = step * batch_size + process_index * local + np.arange(local)  # global stream positions
  epochs, offsets = np.divmod(positions, num_train)
  indices = np.empty(local, np.int64)
  for epoch in np.unique(epochs):
    permutation = np.random.default_rng([seed, int(epoch)]).permutation(num_train)
    indices[epochs == epoch] = permutation[offsets[epochs == epoch]]
  images = split.train_images[indices]
  if max_shift:
    rng = np.random.default_rng([seed, step, 1 + process_index])
    images = _shift_images(images, rng.integers(-max_shift, max_shift + 1, size=(local, 2)))
  if grid is not None:
    images = resize_images(images, grid)
  return {"images": split.standardize(images)[..., None], "labels": split.train_labels[indices]}


def eval_batches(split: DigitsSplit, batch_size: int, *, process_index: int = 0, process_count: int = 1,
                 grid: tuple[int, int] | None = None, eval_split: str = "test") -> Iterator[dict[str, np.ndarray]]:
  """Every image of `eval_split` (one of EVAL_SPLITS) exactly once, in order, in global batches of
  `batch_size` (this process's slice).

  The last global batch is padded with zero images whose `weights` are 0 (all others 1), so every batch has
  the same shape and averages weighted by `weights` count each image once across processes.
  """
  if eval_split not in EVAL_SPLITS:
    raise ValueError(f"eval_batches: eval_split must be one of {EVAL_SPLITS}, got {eval_split!r}")
  local = _check_process(batch_size, process_index, process_count)
  images, labels = split.side(eval_split)
  images = split.standardize(resize_images(images, grid) if grid else images)
  for start in range(0, len(labels), batch_size):
    rows = np.arange(start + process_index * local, start + (process_index + 1) * local)
    valid = rows < len(labels)
    safe_rows = np.where(valid, rows, 0)
    yield {"images": np.where(valid[:, None, None], images[safe_rows], 0.0).astype(np.float32)[..., None],
           "labels": np.where(valid, labels[safe_rows], 0).astype(np.int32),
           "weights": valid.astype(np.float32)}


def to_unit_range(images: np.ndarray) -> np.ndarray:
  """Images on the data set's 0..16 scale (any value above 1) mapped to [0, 1]; others kept as they are."""
  images = np.asarray(images, np.float32)
  return images / _RAW_MAX if images.max(initial=0.0) > 1.0 else images


def read_image_file(path: str) -> np.ndarray:
  """One grey-scale image `[height, width]` in [0, 1], ink high, from a `.npy` array or an image file.

  `.npy`: a 2D array; values above 1 are taken to be on the data set's 0..16 scale. Any other file: an image
  as `image_files.read_image` reads every user's image (PNG, JPEG, TIFF; EXIF orientation, 16-bit and
  transparent images handled; a mostly light image, dark ink on white paper, inverted so that ink is high as in
  the data set).
  """
  if not os.path.exists(path):
    raise ValueError(f"read_image_file: no such file {path!r}")
  if path.endswith(".npy"):
    image = read_npy(path)
    if image.ndim != 2:
      raise ValueError(f"read_image_file: {path!r} must hold a 2D [height, width] array, got {list(image.shape)}")
    return image
  return image_files.read_image(path)


def read_npy(path: str) -> np.ndarray:
  """A `.npy` of grey images, [height, width] or a stack [n, height, width], in [0, 1] (`to_unit_range`).

  Refused, naming the file: another rank, a last axis of 3 or 4 (an RGB or RGBA picture [height, width, 3], which
  a stack would read as `height` images `width` x 3), an array of no pixels, values that are not real numbers,
  and values outside [0, 16] or not finite (a 0..255 picture would be read as ink everywhere)."""
  if os.path.isdir(path):
    raise ValueError(f"{path!r} is a directory, not a .npy file")
  try:
    array = np.load(path)
  except (OSError, ValueError) as error:
    raise ValueError(f"{path!r} cannot be read as a .npy array ({error})") from None
  if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] in (3, 4)):
    raise ValueError(f"{path!r} holds an array of shape {list(array.shape)}: a .npy input is a grey image "
                     "[height, width] or a stack [n, height, width] (save a colour picture as PNG)")
  if not array.size:  # no image, or one of no pixels: the digits' model failed on an empty batch, and the
    # segmenter said a click lay outside a "5x0 image"
    raise ValueError(f"{path!r} holds no pixels (shape {list(array.shape)})")
  if array.dtype.kind not in "biuf":  # strings, dates, complex numbers: astype failed without naming the file
    raise ValueError(f"{path!r} holds {array.dtype} values: a .npy image holds real numbers")
  array = array.astype(np.float32)
  if not np.isfinite(array).all():
    raise ValueError(f"{path!r} holds NaN or infinite pixel values")
  if array.min(initial=0.0) < 0 or array.max(initial=0.0) > _RAW_MAX:
    raise ValueError(f"{path!r} holds values from {array.min():g} to {array.max():g}: a .npy image is on the data "
                     f"set's 0..{_RAW_MAX:g} scale or in [0, 1] (save a 0..255 picture as PNG)")
  return to_unit_range(array)
