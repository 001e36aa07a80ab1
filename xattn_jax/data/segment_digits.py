"""Promptable segmentation scenes made of scikit-learn's digits: click a digit (or box it), get its mask.

A scene places 2-4 digits (the bundled 8x8 images, resized to `digit_size`) at random on a square canvas;
digits may touch or overlap (the canvas is the pixel-wise maximum). Digit i's mask is its own resized
pixels above `threshold` (on the data set's 0..16 scale), including the pixels another digit covers.
Placements are drawn until every digit keeps at least `min_visible` of its mask outside the others, and one
pixel at least (min_visible=0 too), so every digit has strokes that belong to it alone.

Prompts are tokens: `points` [P, 2] (row, column) in [0, 1] canvas units (a pixel's centre for a click,
a corner for a box) and `point_labels` [P] (PAD / POSITIVE / NEGATIVE / BOX_TOP_LEFT / BOX_BOTTOM_RIGHT).
The prompt kinds (PROMPT_KINDS):
  click:     one positive click on a stroke pixel of the target alone;
  clicks:    that click, plus up to max_clicks - 1 more: positive on the target, negative on the others;
  box:       the target mask's bounding box (two corner tokens), jittered by up to a pixel in training;
  ambiguous: one click on a pixel two digits share; the target is either (the other is `alt_masks`).

Train, validation and test scenes each use their own side's source images only (the split of
`xattn_jax.data.digits.load_digits_split`, by source image). Everything is a pure function of
(seed, stream, index): batch `step` of training is the same whenever it is asked for.
Host-side numpy: images float32 [b, H, W, 1] in [0, 1], masks float32 [b, H, W] in {0, 1}.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from xattn_jax.data import digits

PAD, POSITIVE, NEGATIVE, BOX_TOP_LEFT, BOX_BOTTOM_RIGHT = range(5)
NUM_POINT_LABELS = 5  # PAD included: the type embeddings are indexed by label
PROMPT_KINDS = ("click", "clicks", "box", "ambiguous")
_PLACEMENT_TRIES = 200


@dataclasses.dataclass(frozen=True)
class SceneOptions:
  """What a scene is made of (see the module docstring)."""
  canvas: int = 32
  digit_size: int = 12
  min_digits: int = 2
  max_digits: int = 4
  threshold: float = 4.0  # on the 0..16 scale
  min_visible: float = 0.6
  max_clicks: int = 3

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(f"SceneOptions: need 1 <= min_digits <= max_digits, got min_digits={self.min_digits}, "
                       f"max_digits={self.max_digits}")
    if not 0 < self.digit_size <= self.canvas:
      raise ValueError(f"SceneOptions: need 0 < digit_size <= canvas, got digit_size={self.digit_size}, "
                       f"canvas={self.canvas}")
    if not 0.0 <= self.min_visible <= 1.0 or self.max_clicks < 1:
      raise ValueError(f"SceneOptions: need min_visible in [0, 1] and max_clicks >= 1, got "
                       f"min_visible={self.min_visible}, max_clicks={self.max_clicks}")

  @property
  def num_prompt_tokens(self) -> int:
    """P: the padded length of every prompt (a box takes two tokens)."""
    return max(self.max_clicks, 2)


@dataclasses.dataclass(frozen=True)
class Scene:
  """One canvas [H, W] in [0, 1], its digits' masks [n, H, W] bool and their labels [n]."""
  image: np.ndarray
  masks: np.ndarray
  labels: np.ndarray


class DigitPool:
  """Source digits resized to the scene's digit_size: pixels [n, s, s] in [0, 1] and masks [n, s, s]."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, options: SceneOptions):
    self.pixels = np.clip(digits.resize_images(images, (options.digit_size,) * 2), 0.0, 1.0)
    self.masks = self.pixels > options.threshold / 16.0
    self.labels = labels
    keep = self.masks.any(axis=(1, 2))  # an image with no pixel above the threshold has no mask
    self.pixels, self.masks, self.labels = self.pixels[keep], self.masks[keep], self.labels[keep]


def load_pools(options: SceneOptions, *, test_fraction: float = 0.2, split_seed: int = 0,
               validation_fraction: float = digits.VALIDATION_FRACTION) -> dict[str, DigitPool]:
  """{split: pool} for each of digits.SPLITS: the digits split by source image, resized for `options`."""
  split = digits.load_digits_split(test_fraction=test_fraction, split_seed=split_seed,
                                   validation_fraction=validation_fraction)
  return {name: DigitPool(*split.side(name), options) for name in digits.SPLITS}


def make_scene(pool: DigitPool, rng: np.random.Generator, options: SceneOptions) -> Scene:
  """A canvas of min_digits..max_digits digits of `pool`, each keeping min_visible of its mask alone.

  Placements are drawn up to _PLACEMENT_TRIES times; a count that keeps failing is lowered by one (a
  single digit always fits).
  """
  size, canvas = options.digit_size, options.canvas
  for count in range(int(rng.integers(options.min_digits, options.max_digits + 1)), 0, -1):
    for _ in range(_PLACEMENT_TRIES):
      chosen = rng.choice(len(pool.labels), size=count, replace=False)
      corners = rng.integers(0, canvas - size + 1, size=(count, 2))
      pixels = np.zeros((count, canvas, canvas), np.float32)
      masks = np.zeros((count, canvas, canvas), bool)
      for i, (index, (row, col)) in enumerate(zip(chosen, corners)):
        pixels[i, row:row + size, col:col + size] = pool.pixels[index]
        masks[i, row:row + size, col:col + size] = pool.masks[index]
      alone = (masks & (masks.sum(axis=0) == 1)[None]).sum(axis=(1, 2))
      # a pixel of its own where a click on the digit alone goes: a digit covered whole had none to pick
      if np.all(alone >= np.maximum(options.min_visible * masks.sum(axis=(1, 2)), 1)):
        return Scene(image=pixels.max(axis=0), masks=masks, labels=pool.labels[chosen])
  raise AssertionError("unreachable: one digit alone keeps all of its mask")


def _pick(rng, cells: np.ndarray) -> np.ndarray:
  """One (row, col) of the True cells of a boolean [H, W]."""
  rows, cols = np.nonzero(cells)
  k = rng.integers(len(rows))
  return np.array([rows[k], cols[k]])


def ambiguous_pairs(scene: Scene) -> list[tuple[int, int]]:
  """The pairs (i, j), i < j, of digits whose masks share a pixel."""
  n = len(scene.masks)
  return [(i, j) for i in range(n) for j in range(i + 1, n) if (scene.masks[i] & scene.masks[j]).any()]


def make_prompt(scene: Scene, rng: np.random.Generator, kind: str, target: int, options: SceneOptions, *,
                other: int | None = None, jitter: bool = False):
  """(points [P, 2] in [0, 1], point_labels [P] int32) of a prompt of `kind` for digit `target`.

  `other` is the digit that shares the clicked pixel of an "ambiguous" prompt (needed there only).
  """
  canvas, length = options.canvas, options.num_prompt_tokens
  points = np.zeros((length, 2), np.float32)
  labels = np.zeros(length, np.int32)
  coverage = scene.masks.sum(axis=0)
  mine = scene.masks[target]
  if kind == "box":
    rows, cols = np.nonzero(mine)
    corners = np.array([[rows.min(), cols.min()], [rows.max() + 1, cols.max() + 1]], np.float32)
    if jitter:
      corners += rng.uniform(-1.0, 1.0, size=corners.shape)
    points[:2] = np.clip(corners, 0, canvas) / canvas
    labels[:2] = (BOX_TOP_LEFT, BOX_BOTTOM_RIGHT)
    return points, labels
  if kind == "ambiguous":
    if other is None:
      raise ValueError("make_prompt: an 'ambiguous' prompt needs the other digit (other=...)")
    points[0] = (_pick(rng, mine & scene.masks[other]) + 0.5) / canvas
    labels[0] = POSITIVE
    return points, labels
  if kind not in ("click", "clicks"):
    raise ValueError(f"make_prompt: kind must be one of {PROMPT_KINDS}, got {kind!r}")
  points[0] = (_pick(rng, mine & (coverage == 1)) + 0.5) / canvas
  labels[0] = POSITIVE
  if kind == "clicks":
    for slot in range(1, int(rng.integers(1, options.max_clicks + 1))):
      others = [i for i in range(len(scene.masks)) if i != target]
      if others and rng.random() < 0.5:
        cells, label = scene.masks[rng.choice(others)] & ~mine, NEGATIVE
      else:
        cells, label = mine & (coverage == 1), POSITIVE
      if cells.any():
        points[slot], labels[slot] = (_pick(rng, cells) + 0.5) / canvas, label
  return points, labels


def _example(scene: Scene, rng, kind: str, options: SceneOptions, *, jitter: bool):
  """One example dict (no batch axis) of `kind` on `scene`; "ambiguous" falls back to "click" without
  an overlap."""
  pairs = ambiguous_pairs(scene) if kind == "ambiguous" else []
  if kind == "ambiguous" and not pairs:
    kind = "click"
  if kind == "ambiguous":
    pair = pairs[rng.integers(len(pairs))]
    target, other = (pair if rng.random() < 0.5 else pair[::-1])
  else:
    target = other = int(rng.integers(len(scene.masks)))
  points, labels = make_prompt(scene, rng, kind, target, options, other=other, jitter=jitter)
  return {"images": scene.image[..., None], "points": points, "point_labels": labels,
          "masks": scene.masks[target].astype(np.float32), "alt_masks": scene.masks[other].astype(np.float32),
          "kinds": np.int32(PROMPT_KINDS.index(kind)), "weights": np.float32(1.0)}


def _stack(examples: list[dict]) -> dict[str, np.ndarray]:
  return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


def train_batch(pool: DigitPool, options: SceneOptions, *, seed: int, step: int, batch_size: int,
                kind_weights: dict[str, float], process_index: int = 0, process_count: int = 1):
  """This process's rows of training batch `step`: a fresh scene and prompt per row, drawn from
  (seed, step, global row), with prompt kinds in proportion to `kind_weights` (names in PROMPT_KINDS).

  Returns images [b, H, W, 1], points [b, P, 2], point_labels [b, P], masks / alt_masks [b, H, W],
  kinds [b] (index in PROMPT_KINDS) and weights [b] (all 1).
  """
  if step < 0 or process_count < 1 or batch_size % process_count or not 0 <= process_index < process_count:
    raise ValueError(f"segment_digits.train_batch: need step >= 0 and batch_size={batch_size} divisible by "
                     f"process_count={process_count} > process_index={process_index}, got step={step}")
  names = sorted(kind_weights)
  if not names or any(name not in PROMPT_KINDS for name in names) or min(kind_weights.values()) < 0:
    raise ValueError(f"segment_digits.train_batch: kind_weights must weigh names in {PROMPT_KINDS} "
                     f"non-negatively, got {kind_weights}")
  probabilities = np.array([kind_weights[name] for name in names], np.float64)
  probabilities /= probabilities.sum()
  local = batch_size // process_count
  examples = []
  for row in range(process_index * local, (process_index + 1) * local):
    rng = np.random.default_rng([seed, 0, step, row])
    scene = make_scene(pool, rng, options)
    examples.append(_example(scene, rng, names[rng.choice(len(names), p=probabilities)], options, jitter=True))
  return _stack(examples)


def eval_examples(pool: DigitPool, options: SceneOptions, *, seed: int, num_scenes: int):
  """The fixed eval prompts: for each of num_scenes scenes of `pool` a click and a box on one digit, and an
  ambiguous click where two digits overlap (scenes without an overlap have none). Same keys as
  train_batch; rows ordered scene by scene."""
  examples = []
  for index in range(num_scenes):
    rng = np.random.default_rng([seed, 1, index])
    scene = make_scene(pool, rng, options)
    target = int(rng.integers(len(scene.masks)))
    for kind in ("click", "box"):
      points, labels = make_prompt(scene, rng, kind, target, options)
      examples.append({"images": scene.image[..., None], "points": points, "point_labels": labels,
                       "masks": scene.masks[target].astype(np.float32),
                       "alt_masks": scene.masks[target].astype(np.float32),
                       "kinds": np.int32(PROMPT_KINDS.index(kind)), "weights": np.float32(1.0)})
    if ambiguous_pairs(scene):
      examples.append(_example(scene, rng, "ambiguous", options, jitter=False))
  return _stack(examples)


def padded_batches(examples: dict[str, np.ndarray], batch_size: int, *, process_index: int = 0,
                   process_count: int = 1):
  """Every row of `examples` once in global batches of batch_size (this process's rows); the last is
  padded with copies of row 0 whose weight is 0."""
  if batch_size % process_count:
    raise ValueError(f"segment_digits.padded_batches: batch_size={batch_size} must be divisible by "
                     f"process_count={process_count}")
  total, local = len(examples["weights"]), batch_size // process_count
  for start in range(0, total, batch_size):
    rows = np.arange(start + process_index * local, start + (process_index + 1) * local)
    valid = rows < total
    batch = {key: value[np.where(valid, rows, 0)] for key, value in examples.items()}
    batch["weights"] = np.where(valid, batch["weights"], 0.0).astype(np.float32)
    yield batch


def click_points(clicks: list[tuple[float, float, int]], options: SceneOptions, *, height: int, width: int):
  """(points [P, 2], point_labels [P]) of clicks given as (x, y, label) in the pixels of an image of
  [height, width] (x = column, y = row; a click at integer (x, y) is that pixel's centre)."""
  if not 1 <= len(clicks) <= options.num_prompt_tokens:
    raise ValueError(f"click_points: need 1 to {options.num_prompt_tokens} clicks, got {len(clicks)}")
  points = np.zeros((options.num_prompt_tokens, 2), np.float32)
  labels = np.zeros(options.num_prompt_tokens, np.int32)
  for slot, (x, y, label) in enumerate(clicks):
    if not (0 <= x < width and 0 <= y < height):
      raise ValueError(f"click_points: click ({x}, {y}) lies outside the {width}x{height} image")
    points[slot] = ((y + 0.5) / height, (x + 0.5) / width)
    labels[slot] = label
  return points, labels
