"""Bundled image-to-text data: strips of scikit-learn digits, each with a text a language model must read from it.

An image is a horizontal strip of 1 to `max_digits` of the bundled 8x8 digits (pixels in [0, 1], ink high),
optionally upscaled by an integer `scale` (nearest neighbour), so images in one batch differ in width and a
ViT with 2x2 patches hands on M = 16 to 64 patch features (17 to 65 with its class token). Each example is a
`VLMExample`: its images and its segments in reading order, where ("image", i) places image i,
("text", s) is given text and ("target", s) is text the model must produce. The kinds (`KINDS`):

  caption  <image> -> "seven two"                            (the digits as words, left to right)
  count    <image> how many digits ? -> "two"
  nth      <image> what is the second digit ? -> "two"
  sum      <image> what is their sum ? -> "nine"             (the sum of the digits in words)
  larger   <image> -> "seven two" <image> -> "four one" which is larger ? -> "first"
           (two images in one text: each caption reads only the image just before it, Flamingo's
           latest-image masking; the two numbers always differ)

Splits (`make_examples(split=...)`, SPLITS), disjoint in two ways:
  * by source image: the "train", "validation" and "test" strips are made of that side's digits in
    `digits.load_digits_split()` (the digits tasks' split: 1,288 / 149 / 360 images), so no validation or
    test digit image is seen in training;
  * by combination: a digit sequence of two or more digits belongs to one split by a stable hash of the
    sequence (`combination_split`: HELD_OUT_FRACTION of them are test-only, VALIDATION_FRACTION
    validation-only), so every validation or test sequence of 2+ digits never occurs in training, in any
    kind, nor in the LM's pretraining texts. A single digit cannot be held out without removing a class:
    1-digit sequences occur in every split.
Validation mirrors test (unseen digit images, unseen sequences): runs evaluate on it while they train and
are chosen by it (`data.eval_split`), so test scores only what was chosen.

Everything is a pure function of (split, seed, example index): `make_examples(n)` is a prefix of
`make_examples(n + k)`. Host-side numpy only; nothing is downloaded (the digits ship with scikit-learn).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import numpy as np

from xattn_jax.data import digits as digits_lib, splits

IMAGE_TOKEN = "<image>"
DIGIT_SIZE = 8  # the side of one bundled digit, in pixels
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
MAX_DIGITS = len(ORDINALS)  # the nth question needs an ordinal for every position
EMPTY = digits_lib.NUM_CLASSES  # the class of a strip position that holds no digit (the encoder's 11th class)
NUM_POSITION_CLASSES = digits_lib.NUM_CLASSES + 1
SPLITS = digits_lib.SPLITS
EVAL_SPLITS = digits_lib.EVAL_SPLITS  # what a run may evaluate on (data.eval_split)
HELD_OUT_FRACTION = 0.2  # of the digit sequences of each length >= 2, test-only
VALIDATION_FRACTION = 0.1  # of those sequences validation-only; of each class's non-test digit images too
_SPLIT_IDS = {"train": 0, "test": 1, "validation": 2}  # seeds the examples' streams (test's kept from 2 splits)
_SPLIT_SEED = 0  # of the combination hash: fixed, so every run holds out the same sequences
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen")


@dataclasses.dataclass(frozen=True)
class VLMExample:
  """One image-to-text example (see the module docstring).

  Attributes:
    images: each float32 [h, w] in [0, 1] (grey, ink high); for the digits h, w are multiples of DIGIT_SIZE.
    segments: in reading order: ("image", i) image i sits here; ("text", str) given text; ("target", str)
      text the model must produce (the loss is on it; generated at eval, in turn).
    kind: a name in KINDS, or "user" for a user's pairs (data.image_text).
    num_digits: digits in the (largest) image, for per-size metrics (0 for a user's pairs).
    digits: the digit sequence of each image, left to right (empty for a user's pairs).
  """
  images: tuple[np.ndarray, ...]
  segments: tuple[tuple[str, object], ...]
  kind: str
  num_digits: int
  digits: tuple[tuple[int, ...], ...] = ()

  def targets(self) -> list[str]:
    """The target texts, in reading order."""
    return [value for role, value in self.segments if role == "target"]


def number_words(n: int) -> str:
  """0 <= n < 100 in English words: 7 -> "seven", 21 -> "twenty one", 30 -> "thirty"."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n < 100:
    raise ValueError(f"number_words: n must be an integer in [0, 100), got {n!r}")
  n = int(n)
  if n < 10:
    return DIGIT_WORDS[n]
  if n < 20:
    return _TEENS[n - 10]
  tens, units = divmod(n, 10)
  return _TENS[tens] + (f" {DIGIT_WORDS[units]}" if units else "")


def digit_words(sequence: Sequence[int]) -> str:
  """A digit sequence as words, left to right: (7, 2) -> "seven two"."""
  return " ".join(DIGIT_WORDS[d] for d in sequence)


def combination_split(sequence: Sequence[int]) -> str | None:
  """The split a digit sequence belongs to ("train", "validation" or "test"), or None (all) for a single
  digit: one stable hash in [0, 1) per sequence, test below HELD_OUT_FRACTION, validation in the next
  VALIDATION_FRACTION."""
  if len(sequence) < 2:
    return None
  hashed = splits.stable_unit_interval("".join(str(int(d)) for d in sequence), _SPLIT_SEED)
  if hashed < HELD_OUT_FRACTION:
    return "test"
  return "validation" if hashed < HELD_OUT_FRACTION + VALIDATION_FRACTION else "train"


# --- the kinds ------------------------------------------------------------------------------------------


def _caption(sequences, rng):
  del rng
  return (("image", 0), ("target", digit_words(sequences[0])))


def _count(sequences, rng):
  del rng
  return (("image", 0), ("text", "how many digits ?"), ("target", number_words(len(sequences[0]))))


def _nth(sequences, rng):
  position = int(rng.integers(len(sequences[0])))
  return (("image", 0), ("text", f"what is the {ORDINALS[position]} digit ?"),
          ("target", DIGIT_WORDS[sequences[0][position]]))


def _sum(sequences, rng):
  del rng
  return (("image", 0), ("text", "what is their sum ?"), ("target", number_words(sum(sequences[0]))))


def _value(sequence) -> int:
  return int("".join(str(d) for d in sequence))


def _larger(sequences, rng):
  del rng
  first, second = sequences
  return (("image", 0), ("target", digit_words(first)), ("image", 1), ("target", digit_words(second)),
          ("text", "which is larger ?"), ("target", "first" if _value(first) > _value(second) else "second"))


@dataclasses.dataclass(frozen=True)
class Kind:
  """One kind of example: how many images it shows and its segments for their digit sequences.

  `segments(sequences, rng)` -> the example's segments; `distinct` asks for images whose numbers differ.
  """
  num_images: int
  segments: Callable[[list[tuple[int, ...]], np.random.Generator], tuple[tuple[str, object], ...]]
  distinct: bool = False


# The registry of kinds: config checks, errors and docs read its names.
KINDS = {
    "caption": Kind(1, _caption),
    "count": Kind(1, _count),
    "nth": Kind(1, _nth),
    "sum": Kind(1, _sum),
    "larger": Kind(2, _larger, distinct=True),
}

# --- source digits and strips ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def source_digits() -> dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]:
  """split -> (images [n, 8, 8] in [0, 1], per class the indices of its images): the digits tasks' fixed split
  (`digits.load_digits_split()`: 1,288 train, 149 validation, 360 test images)."""
  split = digits_lib.load_digits_split(validation_fraction=VALIDATION_FRACTION)
  result = {}
  for name in SPLITS:
    images, labels = split.side(name)
    result[name] = (images, tuple(np.flatnonzero(labels == c) for c in range(digits_lib.NUM_CLASSES)))
  return result


def compose_strip(digit_images: np.ndarray, scale: int = 1) -> np.ndarray:
  """Digit images [n, h, w] side by side -> one strip [h * scale, n * w * scale], upscaled by repetition."""
  digit_images = np.asarray(digit_images, np.float32)
  if digit_images.ndim != 3 or not len(digit_images):
    raise ValueError(f"compose_strip: digit_images must be [n >= 1, height, width], got "
                     f"{list(digit_images.shape)}")
  strip = np.concatenate(list(digit_images), axis=1)
  return np.repeat(np.repeat(strip, scale, axis=0), scale, axis=1)


def _check_split(split: str, caller: str):
  if split not in SPLITS:
    raise ValueError(f"{caller}: split must be one of {SPLITS}, got {split!r}")


def _check_positive_int(value, name: str, caller: str, *, most: int | None = None):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 or (most and value > most):
    bound = f"in [1, {most}]" if most else ">= 1"
    raise ValueError(f"{caller}: {name} must be an integer {bound}, got {value!r}")


def draw_sequence(split: str, rng: np.random.Generator, num_digits: int) -> tuple[int, ...]:
  """A uniformly random digit sequence of length num_digits among those `combination_split` allows in split."""
  while True:  # rejection: a split accepts its share of the draws (combination_split)
    sequence = tuple(int(d) for d in rng.integers(digits_lib.NUM_CLASSES, size=num_digits))
    if combination_split(sequence) in (None, split):
      return sequence


def draw_strip(split: str, rng: np.random.Generator, *, max_digits: int = 4, scale: int = 1,
               num_digits: int | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
  """(strip [8 * scale, 8 * n * scale], its digit sequence) for a random n in [1, max_digits] (or
  num_digits), the sequence allowed in split and each digit a random source image of split."""
  _check_split(split, "draw_strip")
  _check_positive_int(max_digits, "max_digits", "draw_strip", most=MAX_DIGITS)
  _check_positive_int(scale, "scale", "draw_strip")
  n = int(rng.integers(1, max_digits + 1)) if num_digits is None else num_digits
  sequence = draw_sequence(split, rng, n)
  return _strip_of(split, rng, sequence, scale), sequence


def _strip_of(split, rng, sequence, scale):
  images, by_class = source_digits()[split]
  chosen = [by_class[d][rng.integers(len(by_class[d]))] for d in sequence]
  return compose_strip(images[chosen], scale)


def position_labels(sequences: Sequence[Sequence[int]], max_digits: int) -> np.ndarray:
  """int32 [len(sequences), max_digits]: the digit at each strip position, EMPTY past a strip's end."""
  labels = np.full((len(sequences), max_digits), EMPTY, np.int32)
  for row, sequence in enumerate(sequences):
    if len(sequence) > max_digits:
      raise ValueError(f"position_labels: sequence {row} has {len(sequence)} digits, more than "
                       f"max_digits={max_digits}")
    labels[row, :len(sequence)] = sequence
  return labels


# --- examples -------------------------------------------------------------------------------------------


def make_examples(split: str, num_examples: int, seed: int, *, max_digits: int = 4, kinds=KINDS,
                  scale: int = 1) -> list[VLMExample]:
  """num_examples examples of split, each of a uniformly random kind in `kinds` (names in KINDS), with
  1..max_digits digits per image (uniform), their images upscaled by `scale`.

  Example i depends only on (split, seed, i, max_digits, kinds, scale). See the module docstring for the
  two ways the splits are disjoint.
  """
  _check_split(split, "make_examples")
  if isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer)) or num_examples < 0:
    raise ValueError(f"make_examples: num_examples must be an integer >= 0, got {num_examples!r}")
  _check_positive_int(max_digits, "max_digits", "make_examples", most=MAX_DIGITS)
  _check_positive_int(scale, "scale", "make_examples")
  kinds = tuple(kinds)
  unknown = [k for k in kinds if k not in KINDS]
  if not kinds or unknown:
    raise ValueError(f"make_examples: kinds must be a non-empty subset of {tuple(KINDS)}, got {kinds}")
  split_id = _SPLIT_IDS[split]
  examples = []
  for index in range(num_examples):
    rng = np.random.default_rng([seed, split_id, index])
    name = kinds[int(rng.integers(len(kinds)))]
    kind = KINDS[name]
    sequences = []
    while len(sequences) < kind.num_images:
      sequence = draw_sequence(split, rng, int(rng.integers(1, max_digits + 1)))
      if kind.distinct and any(_value(sequence) == _value(other) for other in sequences):
        continue
      sequences.append(sequence)
    images = tuple(_strip_of(split, rng, sequence, scale) for sequence in sequences)
    examples.append(VLMExample(images=images, segments=kind.segments(sequences, rng), kind=name,
                               num_digits=max(map(len, sequences)), digits=tuple(sequences)))
  return examples


def text_of(example: VLMExample) -> str:
  """The example's whole text, IMAGE_TOKEN where its images sit, segments joined by single spaces."""
  return " ".join(IMAGE_TOKEN if role == "image" else str(value) for role, value in example.segments)


def texts(examples: Sequence[VLMExample]) -> list[str]:
  """Each example's whole text (`text_of`): the documents a language model is pretrained on."""
  return [text_of(example) for example in examples]


def described_text_of(example: VLMExample) -> str:
  """The example's text with each image described in words before its marker: "seven two <image> what is
  their sum ? nine". A language model trained on it learns to answer from the description."""
  if len(example.digits) != len(example.images):
    raise ValueError(f"described_text_of: example has {len(example.images)} images but {len(example.digits)} "
                     "digit sequences (a user's pairs have no description)")
  return " ".join(f"{digit_words(example.digits[value])} {IMAGE_TOKEN}" if role == "image" else str(value)
                  for role, value in example.segments)


def lm_corpus(*, num_train: int, num_eval: int, seed: int, max_digits: int = 4, kinds=KINDS,
              describe_images: bool = False) -> tuple[list[str], list[str]]:
  """(train texts, eval texts) for pretraining the VLM's language model on text alone: num_train documents
  from the first "train" examples and num_eval from the first "validation" ones (`make_examples` with scale
  1), one document an example (its text, `text_of`): the LM never reads a test text.

  describe_images: each example gives two documents in a row, its text (`text_of`: the LM learns the language
  but cannot know the answers) and its text with every image described in words (`described_text_of`: the LM
  learns to answer from a description, a skill a connector can use by making the image read like one); the
  num_train and num_eval documents then come from half as many examples.
  """
  def documents(split, count):
    examples = make_examples(split, (count + 1) // 2 if describe_images else count, seed, max_digits=max_digits,
                             kinds=kinds)
    if not describe_images:
      return texts(examples)
    return [doc for example in examples for doc in (text_of(example), described_text_of(example))][:count]

  return documents("train", num_train), documents("validation", num_eval)


# --- batches of images ----------------------------------------------------------------------------------


def canvas_for(max_digits: int, scale: int = 1) -> tuple[int, int]:
  """The (height, width) canvas that holds every strip of up to max_digits digits at scale."""
  return DIGIT_SIZE * scale, DIGIT_SIZE * max_digits * scale


def collate_images(image_lists: Sequence[Sequence[np.ndarray]], *, canvas: tuple[int, int],
                   max_images: int) -> dict[str, np.ndarray]:
  """Each example's images top-left aligned on a zero canvas.

  Args:
    image_lists: per example its images, each [h, w] (grey) or [h, w, c] (all with the same c).
    canvas: (H, W), at least every image's (h, w).
    max_images: image slots per example, at least every example's image count.

  Returns:
    images float32 [b, max_images, H, W, c] (c = 1 for grey), pixel_valid bool [b, max_images, H, W] (True on
    an image's own pixels), image_valid bool [b, max_images] (True where an example has an image).

  Raises ValueError naming the example and image that does not fit, or an example with too many images.
  """
  if len(canvas) != 2 or min(canvas) < 1:
    raise ValueError(f"collate_images: canvas must be (height, width) of positive ints, got {canvas}")
  _check_positive_int(max_images, "max_images", "collate_images")
  height, width = canvas
  channels = None
  for row, images in enumerate(image_lists):
    if len(images) > max_images:
      raise ValueError(f"collate_images: example {row} has {len(images)} images, more than max_images={max_images}")
    for index, image in enumerate(images):
      shape = np.shape(image)
      if len(shape) not in (2, 3):
        raise ValueError(f"collate_images: image {index} of example {row} must be [h, w] or [h, w, c], got {list(shape)}")
      image_channels = shape[2] if len(shape) == 3 else 1
      if channels not in (None, image_channels):
        raise ValueError(f"collate_images: image {index} of example {row} has {image_channels} channels, others "
                         f"{channels}")
      channels = image_channels
      if shape[0] > height or shape[1] > width:
        raise ValueError(f"collate_images: image {index} of example {row} is {shape[0]}x{shape[1]}, larger than "
                         f"the canvas {height}x{width}")
  batch = len(image_lists)
  channels = channels or 1
  images_out = np.zeros((batch, max_images, height, width, channels), np.float32)
  pixel_valid = np.zeros((batch, max_images, height, width), bool)
  image_valid = np.zeros((batch, max_images), bool)
  for row, images in enumerate(image_lists):
    for index, image in enumerate(images):
      image = np.asarray(image, np.float32)
      h, w = image.shape[:2]
      images_out[row, index, :h, :w] = image.reshape(h, w, channels)
      pixel_valid[row, index, :h, :w] = True
      image_valid[row, index] = True
  return {"images": images_out, "pixel_valid": pixel_valid, "image_valid": image_valid}
