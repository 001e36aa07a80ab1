"""Writes a synthetic user corpus of image-caption pairs: 64 x 64 pictures of shapes, captions in words.

Half the pictures hold one shape (circle, square, triangle or cross), big or small, on the left or the right
("a big circle on the left"); half hold two different shapes side by side ("a square left of a cross"): 28
captions in all, each needing the shape, and its size and side or the pair's order, read from the picture.
Shapes are jittered in place and size, so no two pictures are alike. With --color each shape is red, green or
blue, named in the caption ("a big red circle on the left"); red (255, 0, 0) and green (0, 130, 0) are the same
grey, so only an encoder that reads colour (configs/vlm_tsv.py:color=true) can tell them apart. The files are
what configs/vlm_tsv.py reads (`image_path<TAB>text`, paths relative to the file):

  python experiments/make_shape_pairs.py --out=/tmp/shapes            # train.tsv (2,000), eval.tsv (200), img/
  python experiments/make_shape_pairs.py --out=/tmp/colour_shapes --color
  python launch.py --config=configs/vlm_tsv.py --workdir=workdirs/shapes \\
      --config.data.train_file=/tmp/shapes/train.tsv --config.data.eval_file=/tmp/shapes/eval.tsv
"""
from __future__ import annotations

import argparse
import os
import random

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (255, 0, 0), "green": (0, 130, 0), "blue": (0, 0, 255)}  # red and green: grey 76 both
SIZE = 64


def draw_shape(draw, shape: str, cx: int, cy: int, r: int, fill=0) -> None:
  """One shape of radius r centred at (cx, cy), black unless `fill` says otherwise."""
  box = [cx - r, cy - r, cx + r, cy + r]
  if shape == "circle":
    draw.ellipse(box, fill=fill)
  elif shape == "square":
    draw.rectangle(box, fill=fill)
  elif shape == "triangle":
    draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
  else:
    width = max(2, r // 3)
    draw.line(box, fill=fill, width=width)
    draw.line([cx - r, cy + r, cx + r, cy - r], fill=fill, width=width)


def picture(rng: random.Random, colour: bool = False):
  """(a white 64 x 64 picture with one or two shapes, its caption): grey with black shapes, or with `colour`
  RGB with red, green or blue ones."""
  from PIL import Image, ImageDraw
  image = Image.new("RGB" if colour else "L", (SIZE, SIZE), (255, 255, 255) if colour else 255)
  draw = ImageDraw.Draw(image)

  def paint():  # (fill, the word for it in the caption, with its space)
    if not colour:
      return 0, ""
    name = rng.choice(sorted(COLOURS))
    return COLOURS[name], f"{name} "

  if rng.random() < 0.5:
    shape, big, side = rng.choice(SHAPES), rng.random() < 0.5, rng.choice(("left", "right"))
    r = rng.randint(11, 14) if big else rng.randint(5, 7)
    cx = rng.randint(16, 20) if side == "left" else rng.randint(44, 48)
    fill, word = paint()
    draw_shape(draw, shape, cx, rng.randint(22, 42), r, fill)
    return image, f"a {'big' if big else 'small'} {word}{shape} on the {side}"
  left, right = rng.sample(SHAPES, 2)
  (left_fill, left_word), (right_fill, right_word) = paint(), paint()
  draw_shape(draw, left, rng.randint(14, 20), rng.randint(22, 42), rng.randint(7, 10), left_fill)
  draw_shape(draw, right, rng.randint(44, 50), rng.randint(22, 42), rng.randint(7, 10), right_fill)
  return image, f"a {left_word}{left} left of a {right_word}{right}"


def write_split(out: str, split: str, count: int, seed: int, colour: bool = False) -> str:
  rng = random.Random(seed)
  lines = []
  for index in range(count):
    image, caption = picture(rng, colour)
    name = f"img/{split}_{index}.png"
    image.save(os.path.join(out, name))
    lines.append(f"{name}\t{caption}\n")
  path = os.path.join(out, f"{split}.tsv")
  with open(path, "w") as f:
    f.writelines(lines)
  return path


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="folder for train.tsv, eval.tsv and img/")
  parser.add_argument("--train", type=int, default=2000, help="training pairs")
  parser.add_argument("--eval", type=int, default=200, help="eval pairs (another seed: other pictures)")
  parser.add_argument("--color", action="store_true", help="red, green or blue shapes, named in the captions")
  args = parser.parse_args()
  if args.train < 1 or args.eval < 1:
    parser.error(f"--train and --eval must be >= 1, got {args.train} and {args.eval}")
  os.makedirs(os.path.join(args.out, "img"), exist_ok=True)
  for split, count, seed in (("train", args.train, 0), ("eval", args.eval, 1)):
    print(write_split(args.out, split, count, seed, args.color))


if __name__ == "__main__":
  main()
