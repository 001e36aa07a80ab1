"""The bundled image-to-text digits: disjoint splits, texts read from the images in order, image batches."""
import collections
import hashlib
import itertools

import numpy as np
import pytest

from xattn_jax.data import digits, vlm_digits

# make_examples("test", 40, seed=0) at commit 6077f7c, before the validation split: its first texts and a
# digest of all its images
TEST_TEXTS_BEFORE_VALIDATION = ["<image> what is the second digit ? nine", "<image> what is their sum ? twenty one",
                                "<image> what is the second digit ? one"]
TEST_IMAGES_BEFORE_VALIDATION = "18ea309504d2345ce024206b90ef139adc7e7cc3"


@pytest.fixture(scope="module")
def examples():
  return {split: vlm_digits.make_examples(split, 600, seed=0) for split in vlm_digits.SPLITS}


def _source_keys(split):
  images, _ = vlm_digits.source_digits()[split]
  return {image.tobytes() for image in images}


def _cells(example):
  """The 8x8 digit images each strip of the example is made of."""
  size = vlm_digits.DIGIT_SIZE
  return [image[:, k * size:(k + 1) * size] for image in example.images for k in range(image.shape[1] // size)]


def test_splits_share_no_source_image(examples):
  sources = {split: _source_keys(split) for split in vlm_digits.SPLITS}
  assert not sources["train"] & sources["validation"] and not sources["train"] & sources["test"]
  assert not sources["validation"] & sources["test"]
  for split in vlm_digits.SPLITS:
    for example in examples[split]:
      assert all(cell.tobytes() in sources[split] for cell in _cells(example))
  # validation holds about VALIDATION_FRACTION of each class of the non-test digits; test keeps the digits tasks'
  validation, train = vlm_digits.source_digits()["validation"][1], vlm_digits.source_digits()["train"][1]
  for held, kept in zip(validation, train):
    assert 0.08 < len(held) / (len(held) + len(kept)) < 0.13
  assert len(vlm_digits.source_digits()["test"][0]) == len(digits.load_digits_split().test_labels)


def test_splits_share_no_sequence_of_two_or_more_digits(examples):
  def sequences(split):
    return {seq for example in examples[split] for seq in example.digits if len(seq) >= 2}
  found = {split: sequences(split) for split in vlm_digits.SPLITS}
  assert all(found.values())
  for a, b in itertools.combinations(vlm_digits.SPLITS, 2):
    assert not found[a] & found[b], (a, b)
  for split in vlm_digits.SPLITS:
    assert all(vlm_digits.combination_split(seq) == split for seq in found[split])
  shares = collections.Counter(vlm_digits.combination_split(s) for s in itertools.product(range(10), repeat=3))
  assert abs(shares["test"] / 1000 - vlm_digits.HELD_OUT_FRACTION) < 0.04
  assert abs(shares["validation"] / 1000 - vlm_digits.VALIDATION_FRACTION) < 0.04


def test_test_examples_do_not_move_when_a_validation_split_is_carved_from_train():
  # The test split's images, sequences and example streams are those of the two-way split before
  # validation existed, so test scores of runs on either side of the change read the same examples.
  examples = vlm_digits.make_examples("test", 40, seed=0)
  assert [vlm_digits.text_of(e) for e in examples[:3]] == TEST_TEXTS_BEFORE_VALIDATION
  digest = hashlib.sha1(b"".join(image.tobytes() for e in examples for image in e.images)).hexdigest()
  assert digest == TEST_IMAGES_BEFORE_VALIDATION


def test_examples_are_deterministic_and_prefixes_of_longer_lists(examples):
  again = vlm_digits.make_examples("train", 50, seed=0)
  assert [vlm_digits.text_of(e) for e in again] == [vlm_digits.text_of(e) for e in examples["train"][:50]]
  assert all(np.array_equal(a, b) for x, y in zip(again, examples["train"]) for a, b in zip(x.images, y.images))
  other_seed = vlm_digits.make_examples("train", 50, seed=1)
  assert [vlm_digits.text_of(e) for e in other_seed] != [vlm_digits.text_of(e) for e in again]


def test_every_kind_and_digit_count_occurs(examples):
  assert {e.kind for e in examples["train"]} == set(vlm_digits.KINDS)
  assert {e.num_digits for e in examples["train"]} == {1, 2, 3, 4}


def test_images_are_strips_of_their_digits(examples):
  split = vlm_digits.source_digits()["train"]
  labels_of = {split[0][i].tobytes(): c for c, indices in enumerate(split[1]) for i in indices}
  for example in examples["train"][:100]:
    for image, sequence in zip(example.images, example.digits):
      assert image.shape == (8, 8 * len(sequence)) and image.dtype == np.float32
      assert 0.0 <= image.min() and image.max() <= 1.0
    assert [labels_of[cell.tobytes()] for cell in _cells(example)] == [d for s in example.digits for d in s]


def test_texts_are_read_from_the_images_in_order(examples):
  for example in examples["train"]:
    sequence = example.digits[0]
    role, value = zip(*example.segments)
    target = example.targets()[-1]
    if example.kind == "caption":
      assert target == vlm_digits.digit_words(sequence)
    elif example.kind == "count":
      assert target == vlm_digits.number_words(len(sequence))
    elif example.kind == "nth":
      position = vlm_digits.ORDINALS.index(value[1].split()[3])
      assert target == vlm_digits.DIGIT_WORDS[sequence[position]]
    elif example.kind == "sum":
      assert target == vlm_digits.number_words(sum(sequence))
    else:
      first, second = (int("".join(map(str, s))) for s in example.digits)
      assert role == ("image", "target", "image", "target", "text", "target")
      assert value[1] == vlm_digits.digit_words(example.digits[0])
      assert value[3] == vlm_digits.digit_words(example.digits[1])
      assert target == ("first" if first > second else "second")


def test_larger_example_places_each_caption_after_its_own_image():
  example = next(e for e in vlm_digits.make_examples("test", 40, seed=3) if e.kind == "larger")
  assert example.segments[0] == ("image", 0) and example.segments[2] == ("image", 1)
  assert vlm_digits.text_of(example).startswith(f"{vlm_digits.IMAGE_TOKEN} ")
  assert vlm_digits.text_of(example).count(vlm_digits.IMAGE_TOKEN) == 2


def test_lm_texts_mark_images_with_the_image_token():
  example = vlm_digits.make_examples("train", 1, seed=0, kinds=("count",))[0]
  [text] = vlm_digits.texts([example])
  assert text == f"{vlm_digits.IMAGE_TOKEN} how many digits ? {vlm_digits.number_words(example.num_digits)}"


def test_described_texts_put_each_images_digits_before_its_marker(examples):
  for example in examples["train"][:100]:
    described = vlm_digits.described_text_of(example)
    expected = vlm_digits.text_of(example)
    for sequence in example.digits:  # each marker in turn gains its own image's words
      expected = expected.replace(f"{vlm_digits.IMAGE_TOKEN}", f"{vlm_digits.digit_words(sequence)} \0", 1)
    assert described == expected.replace("\0", vlm_digits.IMAGE_TOKEN)
  larger = next(e for e in examples["test"] if e.kind == "larger")
  first, second = (vlm_digits.digit_words(s) for s in larger.digits)
  assert vlm_digits.described_text_of(larger).startswith(
      f"{first} {vlm_digits.IMAGE_TOKEN} {first} {second} {vlm_digits.IMAGE_TOKEN} {second} which is larger ?")


def test_lm_corpus_with_described_images_pairs_each_text_with_its_description():
  plain_train, plain_eval = vlm_digits.lm_corpus(num_train=15, num_eval=5, seed=2)
  train, eval_ = vlm_digits.lm_corpus(num_train=30, num_eval=9, seed=2, describe_images=True)
  assert (len(train), len(eval_)) == (30, 9)  # documents, from half as many examples
  assert train[0::2] == plain_train and eval_[0::2] == plain_eval
  examples = vlm_digits.make_examples("train", 15, seed=2)
  assert train[1::2] == [vlm_digits.described_text_of(e) for e in examples]
  sums = [e for e in examples if e.kind == "sum"]
  assert sums and all(vlm_digits.described_text_of(e).endswith(vlm_digits.number_words(sum(e.digits[0])))
                      for e in sums)


def test_a_users_pair_has_no_description():
  example = vlm_digits.VLMExample(images=(np.zeros((8, 8), np.float32),), segments=(("image", 0), ("target", "a")),
                                  kind="user", num_digits=0)
  with pytest.raises(ValueError, match="1 images but 0 digit sequences"):
    vlm_digits.described_text_of(example)


def test_scale_upscales_by_repetition():
  small, large = (vlm_digits.make_examples("train", 3, seed=0, scale=s) for s in (1, 2))
  for a, b in zip(small, large):
    assert np.array_equal(np.repeat(np.repeat(a.images[0], 2, 0), 2, 1), b.images[0])


@pytest.mark.parametrize("n, words", [(0, "zero"), (7, "seven"), (13, "thirteen"), (20, "twenty"),
                                      (36, "thirty six"), (99, "ninety nine")])
def test_number_words(n, words):
  assert vlm_digits.number_words(n) == words


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "valid"}, "split must be one of"), ({"max_digits": 0}, "max_digits"),
    ({"kinds": ("caption", "colour")}, "kinds must be"), ({"scale": 0}, "scale")])
def test_make_examples_rejects_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    vlm_digits.make_examples(**{"split": "train", "num_examples": 2, "seed": 0, **kwargs})


def test_collate_pads_top_left_and_marks_valid_pixels_and_images():
  a, b, c = np.full((8, 8), 0.5, np.float32), np.ones((8, 24), np.float32), np.ones((8, 16), np.float32)
  batch = vlm_digits.collate_images([(a,), (b, c)], canvas=(8, 32), max_images=2)
  assert batch["images"].shape == (2, 2, 8, 32, 1) and batch["pixel_valid"].shape == (2, 2, 8, 32)
  assert batch["image_valid"].tolist() == [[True, False], [True, True]]
  assert batch["pixel_valid"][0, 0].sum() == 64 and batch["pixel_valid"][1, 1, :, :16].all()
  assert not batch["pixel_valid"][1, 1, :, 16:].any() and not batch["pixel_valid"][0, 1].any()
  assert np.array_equal(batch["images"][1, 0, :, :24, 0], b) and not batch["images"][1, 0, :, 24:].any()
  assert np.array_equal(batch["images"][..., 0] * ~batch["pixel_valid"], np.zeros((2, 2, 8, 32)))


@pytest.mark.parametrize("image_lists, max_images, message", [
    ([(np.ones((8, 40)),)], 1, "image 0 of example 0 is 8x40, larger than the canvas 8x32"),
    ([(np.ones((8, 8)),), (np.ones((8, 8)),) * 3], 2, "example 1 has 3 images, more than max_images=2")])
def test_collate_names_what_does_not_fit(image_lists, max_images, message):
  with pytest.raises(ValueError, match=message):
    vlm_digits.collate_images(image_lists, canvas=(8, 32), max_images=max_images)


def test_position_labels_mark_positions_past_the_strip_empty():
  assert vlm_digits.position_labels([(7,), (1, 2, 3)], 3).tolist() == [[7, 10, 10], [1, 2, 3]]
