"""experiments/make_shape_pairs.py writes pairs files that the VLM's reader takes, with the captions' shapes drawn."""
import pathlib
import sys

import numpy as np

from tests import helpers
from xattn_jax.data import image_text

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "make_shape_pairs.py"


def test_the_pairs_are_readable_and_each_caption_says_where_its_ink_is(tmp_path):
  result = helpers.run([sys.executable, str(SCRIPT), f"--out={tmp_path}", "--train=40", "--eval=4"], timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  train = image_text.read_image_text_pairs(tmp_path / "train.tsv", canvas=(64, 64))
  assert len(train) == 40 and len(image_text.read_image_text_pairs(tmp_path / "eval.tsv", canvas=(64, 64))) == 4
  for example in train:
    image, caption = example.images[0], example.targets()[0]
    left, right = image[:, :32].sum(), image[:, 32:].sum()  # ink high (data.image_text inverts white paper)
    if caption.endswith("on the left"):  # (a big shape may reach a few pixels past the middle)
      assert left > 10 * right, caption
    elif caption.endswith("on the right"):
      assert right > 10 * left, caption
    else:
      assert " left of a " in caption and left > 0 and right > 0, caption
  captions = {example.targets()[0] for example in train}
  assert len(captions) > 10 and any(c.startswith("a big") for c in captions) and any("small" in c for c in captions)
  rerun = tmp_path / "again"
  helpers.run([sys.executable, str(SCRIPT), f"--out={rerun}", "--train=40", "--eval=4"], timeout=120)
  assert (rerun / "train.tsv").read_text() == (tmp_path / "train.tsv").read_text()
  np.testing.assert_array_equal(image_text.read_image_text_pairs(rerun / "train.tsv", canvas=(64, 64))[7].images[0],
                                train[7].images[0])


def test_colour_pairs_name_the_colour_each_shape_is_painted(tmp_path):
  result = helpers.run([sys.executable, str(SCRIPT), f"--out={tmp_path}", "--train=30", "--eval=2", "--color"],
                       timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  for example in image_text.read_image_text_pairs(tmp_path / "train.tsv", canvas=(64, 64), grey=False):
    image, words = example.images[0], example.targets()[0].split()
    named = {word for word in words if word in ("red", "green", "blue")}
    assert named, words
    # ink high: a painted pixel has its own channel low after the inversion of the white paper, the others high
    painted = {name for name, channel in (("red", 0), ("green", 1), ("blue", 2))
               if np.any((image[..., channel] < 0.5) & (image.max(axis=-1) > 0.4))}
    assert painted == named, (words, painted)
