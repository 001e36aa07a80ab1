"""Writes a synthetic user corpus of image-caption pairs: 64 x 64 pictures of shapes, captions in words.

Half the pictures hold one shape (circle, square, triangle or cross), big or small, on the left or the right
("a big circle on the left"); half hold two different shapes side by side ("a square left of a cross"): 28
captions in all, each needing the shape, and its size and side or the pair's order, read from the picture.
Shapes are jittered in place and size, so no two pictures are alike. The files are what configs/vlm_tsv.py
reads (`image_path<TAB>text`, paths relative to the file):

  python experiments/make_shape_pairs.py --out=/tmp/shapes            # train.tsv (2,000), eval.tsv (200), img/
  python launch.py --config=configs/vlm_tsv.py --workdir=workdirs/shapes \\
      --config.data.train_file=/tmp/shapes/train.tsv --config.data.eval_file=/tmp/shapes/eval.tsv
"""
from __future__ import annotations

import argparse
import os
import random

SHAPES = ("circle", "square", "triangle", "cross")
SIZE = 64


def draw_shape(draw, shape: str, cx: int, cy: int, r: int) -> None:
  """One black shape of radius r centred at (cx, cy)."""
  box = [cx - r, cy - r, cx + r, cy + r]
  if shape == "circle":
    draw.ellipse(box, fill=0)
  elif shape == "square":
    draw.rectangle(box, fill=0)
  elif shape == "triangle":
    draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=0)
  else:
    width = max(2, r // 3)
    draw.line(box, fill=0, width=width)
    draw.line([cx - r, cy + r, cx + r, cy - r], fill=0, width=width)


def picture(rng: random.Random):
  """(a white 64 x 64 grey picture with one or two black shapes, its caption)."""
  from PIL import Image, ImageDraw
  image = Image.new("L", (SIZE, SIZE), 255)
  draw = ImageDraw.Draw(image)
  if rng.random() < 0.5:
    shape, big, side = rng.choice(SHAPES), rng.random() < 0.5, rng.choice(("left", "right"))
    r = rng.randint(11, 14) if big else rng.randint(5, 7)
    cx = rng.randint(16, 20) if side == "left" else rng.randint(44, 48)
    draw_shape(draw, shape, cx, rng.randint(22, 42), r)
    return image, f"a {'big' if big else 'small'} {shape} on the {side}"
  left, right = rng.sample(SHAPES, 2)
  draw_shape(draw, left, rng.randint(14, 20), rng.randint(22, 42), rng.randint(7, 10))
  draw_shape(draw, right, rng.randint(44, 50), rng.randint(22, 42), rng.randint(7, 10))
  return image, f"a {left} left of a {right}"


def write_split(out: str, split: str, count: int, seed: int) -> str:
  rng = random.Random(seed)
  lines = []
  for index in range(count):
    image, caption = picture(rng)
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
  args = parser.parse_args()
  if args.train < 1 or args.eval < 1:
    parser.error(f"--train and --eval must be >= 1, got {args.train} and {args.eval}")
  os.makedirs(os.path.join(args.out, "img"), exist_ok=True)
  for split, count, seed in (("train", args.train, 0), ("eval", args.eval, 1)):
    print(write_split(args.out, split, count, seed))


if __name__ == "__main__":
  main()
