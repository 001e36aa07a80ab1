"""Randomized positions (Ruoss et al. 2023): xattn_jax.ops.positions.randomized_positions."""
import jax
import numpy as np
import pytest

from xattn_jax.ops import positions as P

draw = jax.jit(P.randomized_positions, static_argnums=(1, 2, 3))


@pytest.mark.parametrize("batch, length, max_position", [(3, 5, 16), (2, 1, 7), (4, 16, 17)])
def test_randomized_positions_are_sorted_distinct_int32_in_range(batch, length, max_position):
  positions = np.asarray(draw(jax.random.key(0), batch, length, max_position))
  assert positions.shape == (batch, length) and positions.dtype == np.int32
  assert np.all(np.diff(positions, axis=-1) > 0)  # strictly increasing: sorted and distinct
  assert positions.min() >= 0 and positions.max() < max_position


def test_randomized_positions_are_a_pure_function_of_the_key():
  first, again = draw(jax.random.key(3), 2, 6, 40), draw(jax.random.key(3), 2, 6, 40)
  other = draw(jax.random.key(4), 2, 6, 40)
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)


def test_randomized_positions_draw_each_row_independently():
  positions = np.asarray(draw(jax.random.key(0), 8, 4, 64))
  assert len({tuple(row) for row in positions}) > 1


def test_randomized_positions_reach_every_position_below_max_position():
  positions = np.asarray(draw(jax.random.key(1), 256, 4, 32))
  np.testing.assert_array_equal(np.unique(positions), np.arange(32))


def test_randomized_positions_of_max_position_tokens_are_every_position():
  np.testing.assert_array_equal(draw(jax.random.key(2), 2, 9, 9), np.broadcast_to(np.arange(9), (2, 9)))


@pytest.mark.parametrize("arguments, name", [((2, 0, 8), "length"), ((0, 4, 8), "batch"), ((2, 4, 0), "max_position"),
                                             ((2, 4.0, 8), "length")])
def test_randomized_positions_refuse_a_bad_size_naming_it(arguments, name):
  with pytest.raises(ValueError, match=f"randomized_positions: {name} must be a positive int"):
    P.randomized_positions(jax.random.key(0), *arguments)


def test_randomized_positions_refuse_more_tokens_than_positions():
  with pytest.raises(ValueError, match=r"length must be <= max_position=8 .*got length=9"):
    P.randomized_positions(jax.random.key(0), 2, 9, 8)


def test_randomized_positions_refuse_a_key_that_is_not_one():
  with pytest.raises(ValueError, match="rng must be a jax.random key"):
    P.randomized_positions(np.zeros(3, np.float32), 2, 4, 8)
