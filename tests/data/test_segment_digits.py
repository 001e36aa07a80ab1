"""Segmentation scenes of composed digits: masks, prompts, determinism, the split by source image."""
import numpy as np
import pytest

from xattn_jax.data import digits, segment_digits as sd

OPTIONS = sd.SceneOptions()
MIX = {"click": 1.0, "clicks": 1.0, "box": 1.0, "ambiguous": 1.0}


@pytest.fixture(scope="module")
def pools():
  return sd.load_pools(OPTIONS)


@pytest.fixture(scope="module")
def batch(pools):
  return sd.train_batch(pools["train"], OPTIONS, seed=0, step=3, batch_size=48, kind_weights=MIX)


def _pixel(point):
  return tuple(np.floor(np.asarray(point) * OPTIONS.canvas).astype(int))


def test_batches_are_a_pure_function_of_seed_and_step(pools, batch):
  again = sd.train_batch(pools["train"], OPTIONS, seed=0, step=3, batch_size=48, kind_weights=MIX)
  other = sd.train_batch(pools["train"], OPTIONS, seed=0, step=4, batch_size=48, kind_weights=MIX)
  for key in batch:
    np.testing.assert_array_equal(again[key], batch[key])
  assert not np.array_equal(other["images"], batch["images"])


def test_process_rows_are_slices_of_the_global_batch(pools, batch):
  second = sd.train_batch(pools["train"], OPTIONS, seed=0, step=3, batch_size=48, kind_weights=MIX, process_index=1,
                          process_count=2)
  np.testing.assert_array_equal(second["images"], batch["images"][24:])


def test_the_canvas_inks_exactly_the_union_of_the_digits_masks(pools):
  for index in range(20):
    scene = sd.make_scene(pools["train"], np.random.default_rng(index), OPTIONS)
    np.testing.assert_array_equal(scene.image > OPTIONS.threshold / 16, scene.masks.any(axis=0))
    assert OPTIONS.min_digits <= len(scene.masks) <= OPTIONS.max_digits


def test_every_digit_keeps_the_visible_share_of_its_mask(pools):
  for index in range(20):
    scene = sd.make_scene(pools["train"], np.random.default_rng(index), OPTIONS)
    alone = (scene.masks & (scene.masks.sum(axis=0) == 1)).sum(axis=(1, 2))
    assert np.all(alone >= OPTIONS.min_visible * scene.masks.sum(axis=(1, 2)))


def test_every_digit_keeps_a_pixel_of_its_own_at_min_visible_zero():
  # a digit another covered whole had no pixel for its click: training stopped with numpy's "high <= 0"
  options = sd.SceneOptions(canvas=16, min_digits=4, max_digits=4, min_visible=0.0)
  pool = sd.load_pools(options)["train"]
  for index in range(40):
    scene = sd.make_scene(pool, np.random.default_rng(index), options)
    assert np.all((scene.masks & (scene.masks.sum(axis=0) == 1)).any(axis=(1, 2)))
  sd.train_batch(pool, options, seed=0, step=4, batch_size=8, kind_weights=MIX)


def test_a_click_lies_on_its_digits_strokes_alone(batch):
  clicks = np.nonzero(batch["kinds"] == sd.PROMPT_KINDS.index("click"))[0]
  assert len(clicks)
  for row in clicks:
    r, c = _pixel(batch["points"][row, 0])
    assert batch["masks"][row, r, c] == 1 and batch["point_labels"][row, 0] == sd.POSITIVE
    assert list(batch["point_labels"][row, 1:]) == [sd.PAD] * (OPTIONS.num_prompt_tokens - 1)


def test_an_ambiguous_click_lies_where_both_readings_overlap(batch):
  rows = np.nonzero(batch["kinds"] == sd.PROMPT_KINDS.index("ambiguous"))[0]
  assert len(rows)
  for row in rows:
    r, c = _pixel(batch["points"][row, 0])
    assert batch["masks"][row, r, c] == 1 and batch["alt_masks"][row, r, c] == 1
    assert not np.array_equal(batch["masks"][row], batch["alt_masks"][row])


def test_a_box_bounds_its_mask_to_within_the_training_jitter(batch):
  for row in np.nonzero(batch["kinds"] == sd.PROMPT_KINDS.index("box"))[0]:
    rows, cols = np.nonzero(batch["masks"][row])
    top_left, bottom_right = batch["points"][row, :2] * OPTIONS.canvas
    assert np.all(np.abs(top_left - [rows.min(), cols.min()]) <= 1.0)
    assert np.all(np.abs(bottom_right - [rows.max() + 1, cols.max() + 1]) <= 1.0)
    assert list(batch["point_labels"][row, :2]) == [sd.BOX_TOP_LEFT, sd.BOX_BOTTOM_RIGHT]


def test_train_validation_and_test_scenes_draw_on_disjoint_source_images(pools):
  train, validation, test = ({image.tobytes() for image in pools[name].pixels} for name in sd.digits.SPLITS)
  assert len(train) > 1000 and len(validation) > 100 and len(test) > 300
  assert not train & test and not train & validation and not validation & test


def test_eval_batches_hold_every_test_prompt_once(pools):
  examples = sd.eval_examples(pools["test"], OPTIONS, seed=0, num_scenes=10)
  batches = list(sd.padded_batches(examples, 8))
  assert sum(b["weights"].sum() for b in batches) == len(examples["kinds"])
  kept = np.concatenate([b["points"][b["weights"] > 0] for b in batches])
  np.testing.assert_array_equal(kept, examples["points"])
  counts = np.bincount(examples["kinds"], minlength=len(sd.PROMPT_KINDS))
  assert counts[sd.PROMPT_KINDS.index("click")] == counts[sd.PROMPT_KINDS.index("box")] == 10


def test_clicks_outside_the_image_raise():
  with pytest.raises(ValueError, match="outside"):
    sd.click_points([(40.0, 3.0, sd.POSITIVE)], OPTIONS, height=32, width=32)
