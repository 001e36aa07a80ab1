"""Properties of the bundled-digits data module."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.image
import numpy as np
import pytest

from xattn_jax.data import digits


@pytest.fixture(scope="module")
def split():
  return digits.load_digits_split()


def test_split_is_stratified_and_covers_the_data_set(split):
  sizes = [len(split.side(name)[1]) for name in digits.SPLITS]
  assert sizes == [1288, 149, 360]
  shares = [np.bincount(split.side(name)[1], minlength=10) / size for name, size in zip(digits.SPLITS, sizes)]
  for share in shares[1:]:
    np.testing.assert_allclose(share, shares[0], atol=0.01)
  # every image of the data set on exactly one side
  every = np.concatenate([split.side(name)[0].reshape(-1, 64) for name in digits.SPLITS])
  from sklearn.datasets import load_digits
  original = (load_digits().images / 16.0).astype(np.float32).reshape(-1, 64)
  assert sorted(map(bytes, every)) == sorted(map(bytes, original))


def test_split_is_the_same_every_time(split):
  again = digits.load_digits_split()
  for name in digits.SPLITS:
    np.testing.assert_array_equal(again.side(name)[0], split.side(name)[0])
    np.testing.assert_array_equal(again.side(name)[1], split.side(name)[1])


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_the_validation_fraction_moves_training_images_only(split, fraction):
  other = digits.load_digits_split(validation_fraction=fraction)
  np.testing.assert_array_equal(other.test_images, split.test_images)
  counts = np.bincount(other.validation_labels, minlength=10)
  np.testing.assert_array_equal(counts, np.ceil(fraction * (counts + np.bincount(other.train_labels, minlength=10))))
  # the held-out images of the smaller fraction stay held out at the larger one (lowest hashes first)
  smaller, larger = (other, split) if fraction < digits.VALIDATION_FRACTION else (split, other)
  held = {bytes(image) for image in larger.validation_images}
  assert all(bytes(image) in held for image in smaller.validation_images)


def test_eval_batches_reject_the_train_split(split):
  with pytest.raises(ValueError, match="eval_split must be one of"):
    next(digits.eval_batches(split, 8, eval_split="train"))


def test_standardised_training_pixels_have_zero_mean_and_unit_std(split):
  pixels = split.standardize(split.train_images)
  assert abs(pixels.mean()) < 1e-5 and abs(pixels.std() - 1.0) < 1e-5


def test_resize_to_the_same_grid_returns_the_images_exactly(split):
  np.testing.assert_array_equal(digits.resize_images(split.test_images, (8, 8)), split.test_images)


def test_resize_keeps_a_linear_ramp_linear():
  # A ramp linear in the row, on an 8x8 grid, resized to 16x12: interior output rows keep equal steps.
  ramp = np.broadcast_to(np.arange(8, dtype=np.float32)[:, None], (1, 8, 8))
  resized = digits.resize_images(ramp, (16, 12))
  assert resized.shape == (1, 16, 12)
  steps = np.diff(resized[0, 1:-1, 0])
  np.testing.assert_allclose(steps, 0.5, atol=1e-6)
  np.testing.assert_allclose(resized[0], resized[0, :, :1].repeat(12, axis=1), atol=1e-6)


def test_train_batch_is_a_pure_function_of_seed_and_step(split):
  a = digits.train_batch(split, 7, seed=3, batch_size=32, max_shift=1)
  b = digits.train_batch(split, 7, seed=3, batch_size=32, max_shift=1)
  c = digits.train_batch(split, 8, seed=3, batch_size=32, max_shift=1)
  np.testing.assert_array_equal(a["images"], b["images"])
  np.testing.assert_array_equal(a["labels"], b["labels"])
  assert not np.array_equal(a["images"], c["images"])


def test_process_slices_tile_the_global_batch(split):
  whole = digits.train_batch(split, 5, seed=0, batch_size=24)
  parts = [digits.train_batch(split, 5, seed=0, batch_size=24, process_index=i, process_count=3) for i in range(3)]
  np.testing.assert_array_equal(np.concatenate([p["images"] for p in parts]), whole["images"])
  np.testing.assert_array_equal(np.concatenate([p["labels"] for p in parts]), whole["labels"])


def test_one_epoch_visits_every_training_image_once(split):
  # 1288 training images = 161 batches of 8: the stream's first epoch is a permutation.
  n = len(split.train_labels)
  assert n % 8 == 0
  images = np.concatenate([digits.train_batch(split, s, seed=1, batch_size=8)["images"] for s in range(n // 8)])
  expected = split.standardize(split.train_images)[..., None]
  order = lambda x: x.reshape(len(x), -1)[np.lexsort(x.reshape(len(x), -1).T)]
  np.testing.assert_array_equal(order(images), order(expected))


def test_eval_batches_cover_each_test_image_once_with_weights(split):
  batches = list(digits.eval_batches(split, 64, grid=(12, 12)))
  assert all(b["images"].shape == (64, 12, 12, 1) for b in batches)
  weights = np.concatenate([b["weights"] for b in batches])
  labels = np.concatenate([b["labels"] for b in batches])[weights > 0]
  assert weights.sum() == len(split.test_labels)
  np.testing.assert_array_equal(labels, split.test_labels)


def test_batch_size_not_divisible_by_process_count_raises(split):
  with pytest.raises(ValueError, match="batch_size"):
    digits.train_batch(split, 0, seed=0, batch_size=10, process_index=0, process_count=3)


def test_png_with_dark_ink_on_white_reads_as_ink_high(tmp_path, split):
  image = split.test_images[0]
  path = str(tmp_path / "digit.png")
  matplotlib.image.imsave(path, 1.0 - image, cmap="gray", vmin=0.0, vmax=1.0)
  np.testing.assert_allclose(digits.read_image_file(path), image, atol=1 / 255 + 1e-6)


def test_a_jpeg_photo_and_ink_on_a_transparent_png_read_as_the_digit(tmp_path, split):
  """The digits' inference read PNGs through matplotlib (alpha dropped: black ink on a transparent ground read as
  an empty image) and refused JPEG; now every user's image goes through data.image_files."""
  from PIL import Image
  image = np.kron(split.test_images[0], np.ones((4, 4), np.float32))  # 32 x 32, ink high in [0, 1]
  paper = np.round((1.0 - image) * 255).astype(np.uint8)  # dark ink on white paper
  Image.fromarray(paper).save(tmp_path / "photo.jpg", quality=95)
  np.testing.assert_allclose(digits.read_image_file(str(tmp_path / "photo.jpg")), image, atol=0.08)
  rgba = np.zeros((32, 32, 4), np.uint8)
  rgba[..., 3] = np.round(image * 255).astype(np.uint8)  # black ink whose opacity is the stroke
  Image.fromarray(rgba, "RGBA").save(tmp_path / "icon.png")
  np.testing.assert_allclose(digits.read_image_file(str(tmp_path / "icon.png")), image, atol=1 / 255 + 1e-6)


@pytest.mark.parametrize("test_fraction", [0.2, 0.1, 0.25, 1 / 3, 0.5, 0.01])
def test_num_test_images_is_the_size_of_the_split_test_set(test_fraction):
  split = digits.load_digits_split(test_fraction=test_fraction)
  assert digits.num_test_images(test_fraction) == len(split.test_labels)


def _blank_after_shift(images, row_shift, column_shift):
  """Which images [n, h, w] hold no ink once translated by (row_shift, column_shift)."""
  shifts = np.tile([row_shift, column_shift], (len(images), 1))
  return ~(digits._shift_images(images, shifts) > 0).any(axis=(1, 2))


def test_max_shift_is_the_largest_shift_that_keeps_every_digit_on_the_canvas():
  from sklearn.datasets import load_digits
  images = load_digits().images.astype(np.float32)  # all 1,797, whichever split trains
  assert digits.largest_safe_shift(images) == digits.MAX_SHIFT
  # A longer shift keeps less of the image, so the four corner shifts (+-s, +-s) are the worst ones.
  corners = lambda s: [(s, s), (s, -s), (-s, s), (-s, -s)]
  assert not any(_blank_after_shift(images, *shift).any() for shift in corners(digits.MAX_SHIFT))
  assert any(_blank_after_shift(images, *shift).any() for shift in corners(digits.MAX_SHIFT + 1))


@pytest.mark.parametrize("array, said", [
    (np.zeros((32, 32, 3), np.uint8), r"shape \[32, 32, 3\]: a \.npy input is a grey image"),  # RGB: read as 32 images
    (np.full((8, 8), 200, np.uint8), r"values from 200 to 200: .* 0\.\.16 scale or in \[0, 1\]"),  # 0..255: all ink
    (np.full((8, 8), -1.0), r"values from -1 to -1"),
    (np.zeros((2, 2, 2, 2)), r"shape \[2, 2, 2, 2\]"),
    (np.array([[np.nan]]), r"NaN or infinite pixel values"),
    (np.zeros((0, 8, 8)), r"no pixels \(shape \[0, 8, 8\]\)"),  # no image: the model failed on an empty batch
    (np.zeros((4, 0)), r"no pixels \(shape \[4, 0\]\)"),
    (np.array([["a", "b"]]), r"<U1 values: a \.npy image holds real numbers"),  # astype's error named no file
    (np.ones((2, 2), complex), r"complex128 values"),
])
def test_a_npy_input_other_than_grey_images_on_a_known_scale_is_refused_naming_it(tmp_path, array, said):
  np.save(tmp_path / "x.npy", array)
  with pytest.raises(ValueError, match=r"x\.npy' holds .*" + said):
    digits.read_npy(str(tmp_path / "x.npy"))


def test_a_npy_stack_and_image_read_on_either_scale(tmp_path):
  np.save(tmp_path / "x.npy", np.full((3, 8, 8), 8, np.uint8))
  np.testing.assert_array_equal(digits.read_npy(str(tmp_path / "x.npy")), np.full((3, 8, 8), 0.5, np.float32))
  np.save(tmp_path / "x.npy", np.full((8, 8), 0.25))
  np.testing.assert_array_equal(digits.read_npy(str(tmp_path / "x.npy")), np.full((8, 8), 0.25, np.float32))


def test_resize_of_a_large_image_is_two_matrix_products():
  """A 4000 x 3000 picture took 16.5 s in one three-operand einsum."""
  image = np.random.default_rng(0).random((1, 600, 450))
  rows, cols = digits._linear_resize_matrix(600, 32), digits._linear_resize_matrix(450, 32)
  np.testing.assert_allclose(digits.resize_images(image, (32, 32))[0], rows @ image[0] @ cols.T, rtol=1e-6)


def test_shrinking_with_antialias_keeps_a_thin_stroke_and_the_mean():
  """A 320 x 320 '7' drawn with 4-pixel strokes lost its top bar on the 32 x 32 canvas (samples between rows)."""
  image = np.zeros((1, 320, 320), np.float32)
  image[0, 97:101, 40:280] = 1.0  # a bar 4 pixels thick, between the rows bilinear sampling reads (94-95, 104-105)
  plain, smooth = digits.resize_images(image, (32, 32)), digits.resize_images(image, (32, 32), antialias=True)
  assert plain.max() == 0.0  # dropped
  assert smooth.max() > 0.15 and abs(smooth.mean() - image.mean()) < 1e-3
  np.testing.assert_array_equal(digits.resize_images(image[:, ::10, ::10], (64, 64), antialias=True),
                                digits.resize_images(image[:, ::10, ::10], (64, 64)))  # enlarging: the same
