"""Batches: fixed shapes, BOS / EOS placement, determinism by step, process slices, buckets, packing, eval."""
import collections

import chex
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from xattn_jax.data import batching, tokenizers

BOS, EOS = tokenizers.BOS_ID, tokenizers.EOS_ID


def random_examples(count, seed=0, max_source=20, max_target=20):
  """Examples whose first source id encodes their index (ids 3.., none special)."""
  rng = np.random.default_rng(seed)
  examples = []
  for i in range(count):
    source = [3 + i] + rng.integers(3, 60, rng.integers(0, max_source)).tolist()
    target = rng.integers(3, 60, rng.integers(1, max_target)).tolist()
    examples.append((source, target))
  return examples


def example_of_row(row_inputs):
  return int(row_inputs[0]) - 3


def nonzero(row):
  return row[row != 0].tolist()


@pytest.fixture(scope="module")
def examples():
  return random_examples(100)


@pytest.fixture(scope="module")
def dataset(examples):
  return batching.TranslationBatches(examples)


def test_batch_has_fixed_int32_shapes(dataset):
  batch = dataset.train_batch(3, seed=0, batch_size=16)
  chex.assert_shape([batch["inputs"]], (16, dataset.max_source_length))
  chex.assert_shape([batch["targets"], batch["decoder_inputs"]], (16, dataset.max_target_length))
  chex.assert_type(list(batch.values()), np.int32)
  assert dataset.max_source_length % 8 == 0 and dataset.max_target_length % 8 == 0


def test_rows_hold_the_example_then_padding_and_targets_end_with_eos(dataset, examples):
  batch = dataset.train_batch(0, seed=1, batch_size=16)
  for inputs, targets in zip(batch["inputs"], batch["targets"]):
    source, target = examples[example_of_row(inputs)]
    assert inputs.tolist() == source + [0] * (len(inputs) - len(source))
    assert targets.tolist() == target + [EOS] + [0] * (len(targets) - len(target) - 1)


def test_decoder_inputs_are_bos_then_targets_shifted_right(dataset):
  batch = dataset.train_batch(5, seed=0, batch_size=16)
  targets, decoder_inputs = batch["targets"], batch["decoder_inputs"]
  np.testing.assert_array_equal(decoder_inputs[:, 0], BOS)
  valid = targets != 0
  np.testing.assert_array_equal(decoder_inputs[:, 1:][valid[:, 1:]], targets[:, :-1][valid[:, 1:]])
  np.testing.assert_array_equal(decoder_inputs != 0, valid)


def test_train_batch_is_a_pure_function_of_seed_and_step(examples, dataset):
  fresh = batching.TranslationBatches(examples)
  for step in (0, 7, 6, 123):  # 6 steps per epoch at batch 16: 7 and 123 are later epochs
    a, b = dataset.train_batch(step, seed=4, batch_size=16), fresh.train_batch(step, seed=4, batch_size=16)
    chex.assert_trees_all_equal(a, b)
  assert not np.array_equal(dataset.train_batch(0, seed=4, batch_size=16)["inputs"],
                            dataset.train_batch(0, seed=5, batch_size=16)["inputs"])


def test_an_epoch_visits_distinct_examples_and_epochs_differ(dataset):
  steps = dataset.steps_per_epoch(16)
  assert steps == 100 // 16
  def epoch(e):
    return [example_of_row(r) for s in range(e * steps, (e + 1) * steps)
            for r in dataset.train_batch(s, seed=0, batch_size=16)["inputs"]]
  first, second = epoch(0), epoch(1)
  assert len(set(first)) == len(first) == steps * 16
  assert first != second


@pytest.mark.parametrize("num_units, batch_size", [(3, 8), (5, 10), (7, 7), (1, 4)])
def test_units_fewer_than_a_batch_fill_it_each_as_evenly_as_possible(num_units, batch_size):
  """A corpus smaller than one batch used to stop the run; now every batch holds each unit
  batch_size // num_units times or once more, and which units get the extra copy changes."""
  orders = [batching.epoch_order(np.random.default_rng([0, epoch]), num_units, batch_size) for epoch in range(6)]
  for order in orders:
    counts = np.bincount(order, minlength=num_units)
    assert order.shape == (batch_size,) and set(counts) <= {batch_size // num_units, -(-batch_size // num_units)}
  if batch_size % num_units:
    assert len({tuple(np.bincount(o, minlength=num_units)) for o in orders}) > 1
  assert batching.steps_per_epoch(num_units, batch_size) == 1


def test_a_batch_larger_than_the_data_trains_on_repeated_examples(examples, dataset):
  batch = dataset.train_batch(3, seed=0, batch_size=250)  # 100 examples
  rows = [example_of_row(r) for r in batch["inputs"]]
  assert len(rows) == 250 and len(set(rows)) == 100
  chex.assert_trees_all_equal(batch, batching.TranslationBatches(examples).train_batch(3, seed=0, batch_size=250))


def test_epoch_order_with_enough_units_is_one_permutation_cut_to_whole_batches():
  order = batching.epoch_order(np.random.default_rng([1, 2]), 10, 4)
  np.testing.assert_array_equal(order, np.random.default_rng([1, 2]).permutation(10)[:8])
  with pytest.raises(ValueError, match="no training examples"):
    batching.epoch_order(np.random.default_rng(0), 0, 4)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_are_disjoint_and_make_up_the_global_batch(dataset, process_count):
  global_batch = dataset.train_batch(9, seed=2, batch_size=16)
  parts = [dataset.train_batch(9, seed=2, batch_size=16, process_index=p, process_count=process_count)
           for p in range(process_count)]
  for key, value in global_batch.items():
    np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), value)


def test_global_batch_not_divisible_by_process_count_raises(dataset):
  with pytest.raises(ValueError, match="batch_size=10 .* divisible by process_count=4"):
    dataset.train_batch(0, seed=0, batch_size=10, process_index=0, process_count=4)


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1}, "step must be a non-negative integer"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"process_index": 2, "process_count": 2}, r"process_index must be in \[0, process_count=2\)"),
])
def test_bad_train_batch_arguments_raise(dataset, kwargs, message):
  arguments = {"step": 0, "seed": 0, "batch_size": 8} | kwargs
  step = arguments.pop("step")
  with pytest.raises(ValueError, match=message):
    dataset.train_batch(step, **arguments)


def test_bucketing_uses_a_bounded_set_of_multiple_of_8_shapes():
  examples = random_examples(400, seed=3, max_source=60, max_target=45)
  bucketed = batching.TranslationBatches(examples, length_bucketing=True)
  shapes, padding, padding_fixed = set(), 0, 0
  fixed = batching.TranslationBatches(examples)
  for step in range(3 * bucketed.steps_per_epoch(16)):
    batch = bucketed.train_batch(step, seed=0, batch_size=16)
    shapes.add((batch["inputs"].shape[1], batch["targets"].shape[1]))
    padding += np.sum(batch["inputs"] == 0)
    padding_fixed += np.sum(fixed.train_batch(step, seed=0, batch_size=16)["inputs"] == 0)
  allowed = {(s, t) for s in range(8, bucketed.max_source_length + 1, 8)
             for t in range(8, bucketed.max_target_length + 1, 8)}
  assert shapes <= allowed and len(shapes) > 1
  assert padding < 0.5 * padding_fixed


def test_bucketed_epoch_still_visits_distinct_examples_and_shape_is_global():
  examples = random_examples(64, seed=5, max_source=40)
  bucketed = batching.TranslationBatches(examples, length_bucketing=True)
  seen = []
  for step in range(bucketed.steps_per_epoch(8)):
    parts = [bucketed.train_batch(step, seed=1, batch_size=8, process_index=p, process_count=2) for p in range(2)]
    assert parts[0]["inputs"].shape == parts[1]["inputs"].shape
    seen += [example_of_row(r) for part in parts for r in part["inputs"]]
  assert sorted(seen) == list(range(64))


def check_packed_row(batch, r, stream):
  """Segments are 1, 2, ... contiguous from the start; positions restart at 0; padding is all zero."""
  segmentation, position = batch[f"{stream}_segmentation"][r], batch[f"{stream}_position"][r]
  tokens = batch[stream][r]
  used = segmentation != 0
  count = int(used.sum())
  assert used[:count].all() and not used[count:].any()
  assert not tokens[count:].any() and not position[count:].any() and tokens[:count].all()
  segments = segmentation[:count]
  assert segments[0] == 1 and set(np.diff(segments)) <= {0, 1}
  for segment in np.unique(segments):
    np.testing.assert_array_equal(position[segmentation == segment], np.arange(np.sum(segmentation == segment)))


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 40), seed=st.integers(0, 10**6), max_length=st.sampled_from([16, 24, 40]))
def test_packing_keeps_every_token_and_marks_segments(count, seed, max_length):
  examples = random_examples(count, seed=seed, max_source=16, max_target=15)
  packed = batching.TranslationBatches(examples, packing=True, max_source_length=max_length,
                                       max_target_length=max_length)
  recovered = []
  for step in range(packed.num_units):  # batch size 1: one epoch shows every packed row once
    batch = packed.train_batch(step, seed=0, batch_size=1)
    chex.assert_shape([batch["inputs"], batch["inputs_segmentation"]], (1, max_length))
    check_packed_row(batch, 0, "inputs")
    check_packed_row(batch, 0, "targets")
    for segment in range(1, batch["inputs_segmentation"].max() + 1):
      in_source = batch["inputs_segmentation"][0] == segment
      in_target = batch["targets_segmentation"][0] == segment
      target = batch["targets"][0][in_target].tolist()
      assert target[-1] == EOS
      assert batch["decoder_inputs"][0][in_target].tolist() == [BOS] + target[:-1]
      recovered.append((batch["inputs"][0][in_source].tolist(), target[:-1]))
  assert sorted(recovered) == sorted(examples)
  assert packed.num_units <= count


def test_packing_fills_rows(examples):
  packed = batching.TranslationBatches(examples, packing=True, max_source_length=64, max_target_length=64)
  batch = packed.train_batch(0, seed=0, batch_size=8)
  assert np.mean(batch["targets"] != 0) > 0.7
  assert packed.num_units < len(examples) / 3


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_yields_every_example_once_with_weight_zero_padding(examples, process_count):
  dataset = batching.TranslationBatches(examples[:21])
  per_process = [list(dataset.eval_batches(8, process_index=p, process_count=process_count))
                 for p in range(process_count)]
  assert {len(batches) for batches in per_process} == {3}
  indices = collections.Counter()
  for batches in per_process:
    for batch in batches:
      chex.assert_shape([batch["inputs"]], (8 // process_count, dataset.max_source_length))
      real = batch["example_index"] >= 0
      np.testing.assert_array_equal(batch["example_weights"], real.astype(np.float32))
      assert not batch["inputs"][~real].any() and not batch["targets"][~real].any()
      for i, row in zip(batch["example_index"][real], batch["inputs"][real]):
        assert example_of_row(row) == i
        indices[int(i)] += 1
  assert indices == collections.Counter(range(21))


def test_overlong_examples_are_truncated_with_a_counted_warning():
  examples = [([5] * 10, [6] * 3), ([5] * 3, [6] * 9), ([5] * 2, [6] * 2)]
  with pytest.warns(UserWarning, match="2 of 3 examples are longer"):
    dataset = batching.TranslationBatches(examples, max_source_length=6, max_target_length=6)
  assert dataset.num_truncated == 2
  rows = {tuple(nonzero(b["inputs"][0])): b for b in dataset.eval_batches(1)}
  assert nonzero(rows[(5,) * 6]["targets"][0]) == [6, 6, 6, EOS]
  assert nonzero(rows[(5,) * 3]["targets"][0]) == [6] * 5 + [EOS]


@pytest.mark.parametrize("examples, kwargs, message", [
    ([([], [4])], {}, r"examples\[0\] has an empty source"),
    ([([4], [4]), ([4, 0], [4])], {}, r"examples\[1\] source holds id 0"),
    ([([4], [4, EOS])], {}, r"examples\[0\] target holds id 2"),
    ([([4], [4])], {"packing": True, "length_bucketing": True}, "choose one"),
    ([([4], [4])], {"max_target_length": 1}, "max_target_length must be >= 2"),
    ([], {}, "examples must be a non-empty sequence"),
])
def test_invalid_examples_or_options_raise(examples, kwargs, message):
  with pytest.raises(ValueError, match=message):
    batching.TranslationBatches(examples, **kwargs)


def test_from_pairs_targets_decode_back_to_the_text():
  pairs = [("Nov 29, 2026", "29 nov. 2026"), ("May 1, 2000", "2000年5月1日")]
  tokenizer = tokenizers.ByteTokenizer()
  dataset = batching.TranslationBatches.from_pairs(pairs, tokenizer)
  batch = next(dataset.eval_batches(2))
  assert [tokenizer.decode(row) for row in batch["targets"]] == [t for _, t in pairs]
  assert [tokenizer.decode(row) for row in batch["inputs"]] == [s for s, _ in pairs]


def test_an_epoch_order_without_sort_keys_is_the_plain_permutation_cut_into_batches():
  order = batching.EpochOrder(100)
  for step in (0, 11, 12, 30):
    epoch, index = divmod(step, 12)
    expected = batching.epoch_order(np.random.default_rng([5, epoch]), 100, 8).reshape(12, 8)[index]
    np.testing.assert_array_equal(order.batch(step, 5, 8), expected)


def test_sorted_epochs_make_batches_of_one_key_in_a_random_order():
  """Bucketing: a batch pads to its own units' shape."""
  keys = np.random.default_rng(0).permutation(np.repeat([3, 1, 2], [40, 24, 32]))  # 96 units, 12 batches of 8
  order = batching.EpochOrder(96, keys)
  epoch = [order.batch(step, 5, 8) for step in range(12)]
  assert sorted(np.concatenate(epoch).tolist()) == list(range(96))  # each unit once
  assert all(len(set(keys[batch])) == 1 for batch in epoch)  # the counts are whole batches: none mixed
  # The epoch's permutation sorted by key and cut into batches, in another order.
  permutation = batching.epoch_order(np.random.default_rng([5, 0]), 96, 8)
  batches = permutation[np.argsort(keys[permutation], kind="stable")].reshape(12, 8)
  assert sorted(map(tuple, batches)) == sorted(map(tuple, epoch))
  assert [keys[batch[0]] for batch in epoch] != sorted(keys[batch[0]] for batch in epoch)
  again = batching.EpochOrder(96, keys)
  np.testing.assert_array_equal(again.batch(7, 5, 8), order.batch(7, 5, 8))  # a pure function of the step
  assert not all(np.array_equal(order.batch(s, 5, 8), order.batch(12 + s, 5, 8)) for s in range(12))
  with pytest.raises(ValueError, match=r"sort_keys must be \[num_units=96\] or .*, got \[95\]"):
    batching.EpochOrder(96, keys[:95])


def test_rows_of_sort_keys_sort_by_their_first_column_then_the_next():
  """A translator's buckets: (padded source length, padded target length)."""
  keys = np.random.default_rng(2).permutation(np.repeat([[2, 1], [1, 3], [1, 2]], [24, 16, 24], axis=0))
  order = batching.EpochOrder(64, keys)
  epoch = [order.batch(step, 0, 8) for step in range(8)]
  assert all(len({tuple(k) for k in keys[batch]}) == 1 for batch in epoch)
  permutation = batching.epoch_order(np.random.default_rng([0, 0]), 64, 8)
  ranked = permutation[np.lexsort((keys[permutation, 1], keys[permutation, 0]))].reshape(8, 8)
  assert sorted(map(tuple, ranked)) == sorted(map(tuple, epoch))
  assert [tuple(keys[b[0]]) for b in ranked] == sorted(tuple(keys[b[0]]) for b in ranked)  # (1, 2) < (1, 3) < (2, 1)
  with pytest.raises(ValueError, match=r"got \[64, 2, 1\]"):
    batching.EpochOrder(64, keys[..., None])
