"""Properties of the boolean mask builders (True = may attend)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xattn_jax.ops import masks


def test_causal_mask_queries_are_the_last_keys_by_default():
  mask = masks.causal_mask(3, 5)
  chex.assert_shape(mask, (1, 1, 3, 5))
  expected = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(mask[0, 0], expected)


def test_causal_mask_square_is_lower_triangular():
  np.testing.assert_array_equal(masks.causal_mask(4)[0, 0], np.tril(np.ones((4, 4), bool)))


def test_causal_mask_offset_moves_the_diagonal():
  np.testing.assert_array_equal(masks.causal_mask(2, 4, offset=0)[0, 0], np.tril(np.ones((2, 4), bool)))


def test_causal_mask_per_batch_offsets_stack_the_scalar_masks():
  offsets = jnp.array([0, 2, 3])
  mask = masks.causal_mask(2, 5, offset=offsets)
  chex.assert_shape(mask, (3, 1, 2, 5))
  for b, offset in enumerate([0, 2, 3]):
    np.testing.assert_array_equal(mask[b], masks.causal_mask(2, 5, offset=offset)[0])


def test_causal_mask_accepts_a_traced_offset():
  traced = jax.jit(lambda offset: masks.causal_mask(1, 4, offset=offset))(2)
  np.testing.assert_array_equal(traced[0, 0, 0], [True, True, True, False])


def test_padding_mask_from_lengths_equals_mask_from_valid():
  valid = jnp.array([[True, True, False], [True, False, False]])
  from_lengths = masks.padding_mask(jnp.array([2, 1]), kv_len=3)
  chex.assert_shape(from_lengths, (2, 1, 1, 3))
  np.testing.assert_array_equal(from_lengths, masks.padding_mask(valid))


def test_lengths_to_valid_marks_positions_below_length():
  np.testing.assert_array_equal(masks.lengths_to_valid(jnp.array([0, 2]), 3),
                                [[False, False, False], [True, True, False]])


def test_segment_mask_attends_within_a_segment_and_padding_sees_nothing():
  ids = jnp.array([[1, 1, 2, 0]])
  mask = masks.segment_mask(ids, ids)
  chex.assert_shape(mask, (1, 1, 4, 4))
  expected = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(mask[0, 0], expected)


def test_segment_mask_serves_cross_attention_with_other_lengths():
  mask = masks.segment_mask(jnp.array([[1, 2]]), jnp.array([[1, 1, 2, 0, 0]]))
  chex.assert_shape(mask, (1, 1, 2, 5))
  np.testing.assert_array_equal(mask[0, 0], [[1, 1, 0, 0, 0], [0, 0, 1, 0, 0]])


def test_combine_masks_is_logical_and_skipping_none():
  a = jnp.array([[[[True, False, True]]]])
  b = jnp.array([[[[True], [False]]]])
  combined = masks.combine_masks(a, None, b)
  chex.assert_shape(combined, (1, 1, 2, 3))
  np.testing.assert_array_equal(combined[0, 0], [[True, False, True], [False, False, False]])
  assert masks.combine_masks(None, None) is None


@pytest.mark.parametrize("call, needle", [
    (lambda: masks.causal_mask(0, 3), "q_len"),
    (lambda: masks.causal_mask(2, 3, offset=jnp.zeros((2, 2), jnp.int32)), "offset"),
    (lambda: masks.causal_mask(2, 3, offset=1.5), "offset"),
    (lambda: masks.padding_mask(jnp.array([1, 2])), "kv_len"),
    (lambda: masks.padding_mask(jnp.ones((2, 3), jnp.int32)), "valid"),
    (lambda: masks.padding_mask(jnp.ones((2, 3), bool), kv_len=4), "[batch, 4]"),
    (lambda: masks.lengths_to_valid(jnp.ones((2, 2), jnp.int32), 3), "lengths"),
    (lambda: masks.segment_mask(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 3), jnp.int32)), "batch"),
    (lambda: masks.segment_mask(jnp.ones((3,), jnp.int32), jnp.ones((1, 3), jnp.int32)), "query_segment_ids"),
    (lambda: masks.combine_masks(jnp.ones((1, 2)), jnp.ones((1, 2), bool)), "bool"),
    (lambda: masks.combine_masks(jnp.ones((2, 3), bool), jnp.ones((2, 4), bool)), "broadcast"),
])
def test_invalid_mask_arguments_raise_value_error_naming_them(call, needle):
  with pytest.raises(ValueError, match=None) as info:
    call()
  assert needle in str(info.value)


def test_padding_lengths_take_numpy_integers_and_refuse_bools():
  # np.int64(3) was refused as not a static int, and True failed in iota with a TypeError.
  lengths = jnp.array([1, 3])
  np.testing.assert_array_equal(masks.padding_mask(lengths, np.int64(3)), masks.padding_mask(lengths, 3))
  np.testing.assert_array_equal(masks.lengths_to_valid(lengths, np.int32(3)), masks.lengths_to_valid(lengths, 3))
  with pytest.raises(ValueError, match="lengths_to_valid: length must be a positive static int, got True"):
    masks.lengths_to_valid(lengths, True)
  with pytest.raises(ValueError, match="padding_mask: kv_len must be None or a positive static int, got kv_len=0"):
    masks.padding_mask(lengths, 0)


def test_causal_mask_takes_numpy_integer_lengths_and_refuses_bools():
  np.testing.assert_array_equal(masks.causal_mask(np.int64(3), np.int32(5)), masks.causal_mask(3, 5))
  with pytest.raises(ValueError, match="q_len=True"):
    masks.causal_mask(True)
