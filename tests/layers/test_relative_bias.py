"""ALiBi and T5 relative biases as position-encoding modules, and their path through the blocks.

The ops themselves (slopes, buckets, offset invariance of the raw bias) are tested in test_positions.py;
here: the modules' bias shapes and variants, and that attention using them behaves as a relative
encoding should (shift invariance, cached decoding equal to the full pass).
"""
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xattn_jax.layers import blocks
from xattn_jax.layers import positions as position_layers

FEATURES, HEADS, MLP_FEATURES = 16, 4, 32
RELATIVE = ("alibi", "t5_bias")


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _make(name, *, causal=False, **options):
  """A module with (for t5_bias) a random table, so that a bias of zero cannot pass a test by accident."""
  module = position_layers.make_position_encoding(name, features=FEATURES, num_heads=HEADS, causal=causal,
                                                  rngs=nnx.Rngs(0), **options)
  if name == "t5_bias":
    module.table[...] = _normal(3, module.table.shape)
  return module


def _positions(start, length, batch=2):
  return jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))


@functools.cache
def _encoder_block():
  return blocks.EncoderBlock(FEATURES, HEADS, MLP_FEATURES, rngs=nnx.Rngs(1))


@functools.cache
def _decoder_block():
  return blocks.DecoderBlock(FEATURES, HEADS, MLP_FEATURES, rngs=nnx.Rngs(2))


@nnx.jit
def _encode(block, encoding, x, positions):
  return block(x, positions=positions, bias=encoding.attention_bias(positions, positions))


@nnx.jit
def _decoder_pass(block, encoding, x, memory, positions):
  return block(x, memory, positions=positions, self_bias=encoding.attention_bias(positions, positions))


@nnx.jit
def _decode(block, encoding, x, cache, positions):
  key_positions = _positions(0, cache.self_attention.max_length, x.shape[0])  # every cache row
  return block.decode(x, cache, positions=positions, self_bias=encoding.attention_bias(positions, key_positions))


@pytest.mark.parametrize("name", RELATIVE)
@pytest.mark.parametrize("causal", [False, True])
def test_relative_bias_is_batch_heads_queries_keys(name, causal):
  bias = _make(name, causal=causal).attention_bias(_positions(0, 3), _positions(0, 5))
  assert bias.shape == (2, HEADS, 3, 5) and bias.dtype == jnp.float32


@pytest.mark.parametrize("name", RELATIVE)
def test_relative_encodings_add_nothing_to_inputs_and_rotate_nothing(name):
  encoding, x = _make(name), _normal(0, (2, 5, FEATURES))
  np.testing.assert_array_equal(encoding.add_to_inputs(x), x)
  assert encoding.rotary is None


@pytest.mark.parametrize("name", ["none", "learned", "sinusoidal", "rope"])
def test_non_relative_encodings_have_no_attention_bias(name):
  encoding = position_layers.make_position_encoding(name, features=FEATURES, max_length=8, head_dim=4,
                                                    rngs=nnx.Rngs(0))
  assert encoding.attention_bias(_positions(0, 3), _positions(0, 3)) is None


@pytest.mark.parametrize("name", RELATIVE)
@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(shift=st.integers(1, 300))
def test_encoder_output_is_unchanged_when_every_position_shifts(name, shift):
  block, encoding, x = _encoder_block(), _make(name), _normal(4, (2, 6, FEATURES))
  np.testing.assert_allclose(_encode(block, encoding, x, _positions(shift, 6)),
                             _encode(block, encoding, x, _positions(0, 6)), atol=1e-5)


@pytest.mark.parametrize("name", RELATIVE)
def test_encoder_output_depends_on_token_order_through_the_bias(name):
  block, encoding, x = _encoder_block(), _make(name), _normal(4, (2, 6, FEATURES))
  permutation = np.array([1, 0, 2, 3, 5, 4])
  out = _encode(block, encoding, x, _positions(0, 6))
  assert not np.allclose(_encode(block, encoding, x[:, permutation], _positions(0, 6)), out[:, permutation],
                         atol=1e-3)


def test_causal_alibi_equals_symmetric_alibi_under_the_decoder_causal_mask():
  block, memory, x = _decoder_block(), _normal(5, (2, 4, FEATURES)), _normal(6, (2, 6, FEATURES))
  positions = _positions(0, 6)
  np.testing.assert_allclose(_decoder_pass(block, _make("alibi", causal=True), x, memory, positions),
                             _decoder_pass(block, _make("alibi", causal=False), x, memory, positions), atol=1e-5)


def test_unidirectional_t5_bias_gives_every_later_key_the_bias_of_the_query_itself():
  bias = _make("t5_bias", causal=True).attention_bias(_positions(0, 1) + 3, _positions(0, 9))[0, :, 0]
  np.testing.assert_array_equal(bias[:, 4:], np.broadcast_to(bias[:, 3:4], (HEADS, 5)))


def test_bidirectional_t5_bias_tells_keys_before_the_query_from_keys_after_it():
  bias = _make("t5_bias").attention_bias(_positions(3, 1), _positions(0, 7))[0, :, 0]  # offsets -3 .. 3
  assert not np.allclose(bias[:, :3], bias[:, 4:][:, ::-1])


@pytest.mark.parametrize("name", RELATIVE)
def test_decoder_cached_decode_with_relative_bias_equals_full_pass(name):
  block, encoding = _decoder_block(), _make(name, causal=True)
  memory, x = _normal(5, (2, 4, FEATURES)), _normal(6, (2, 6, FEATURES))
  cache = block.init_cache(memory, max_length=8)
  out, cache = _decode(block, encoding, x[:, :3], cache, _positions(0, 3))  # pre-fill the prompt
  outs = [out]
  for i in range(3, 6):
    out, cache = _decode(block, encoding, x[:, i:i + 1], cache, _positions(i, 1))
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), _decoder_pass(block, encoding, x, memory, _positions(0, 6)),
                             atol=1e-5)


def test_t5_table_is_a_zero_initialised_param_trained_through_attention():
  encoding = position_layers.make_position_encoding("t5_bias", features=FEATURES, num_heads=HEADS,
                                                    num_buckets=16, rngs=nnx.Rngs(0))
  assert isinstance(encoding.table, nnx.Param) and encoding.table.shape == (16, HEADS)
  np.testing.assert_array_equal(encoding.table[...], 0.0)
  block, x, positions = _encoder_block(), _normal(7, (2, 6, FEATURES)), _positions(0, 6)

  def loss(encoding, block):
    return jnp.sum(_encode(block, encoding, x, positions) ** 2)

  gradient = nnx.grad(loss)(encoding, block).table[...]
  assert np.abs(gradient).sum() > 0 and np.all(np.isfinite(gradient))


@pytest.mark.parametrize("name", RELATIVE)
def test_relative_encodings_need_num_heads(name):
  with pytest.raises(ValueError, match="num_heads"):
    position_layers.make_position_encoding(name, features=FEATURES, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("causal, num_buckets", [(False, 30), (True, 7), (False, 0)])
def test_t5_bias_rejects_bucket_counts_that_do_not_split_evenly(causal, num_buckets):
  with pytest.raises(ValueError, match=f"num_buckets.*{num_buckets}"):
    _make("t5_bias", causal=causal, num_buckets=num_buckets)


def test_t5_bias_rejects_max_distance_inside_the_exact_range():
  with pytest.raises(ValueError, match="max_distance.*got max_distance=8"):
    _make("t5_bias", num_buckets=32, max_distance=8)


def test_relative_bias_rejects_positions_of_the_wrong_rank():
  with pytest.raises(ValueError, match="query_positions"):
    _make("alibi").attention_bias(jnp.zeros((2, 3, 1), jnp.int32), _positions(0, 3))


def test_t5_bias_refuses_float_positions_instead_of_truncating_them():
  # key - query of -0.5 and +0.5 would both truncate to distance 0 (bucket 0).
  from xattn_jax.ops import relative_bias
  with pytest.raises(ValueError, match=r"query_positions must be integer positions, got float32\[2\]"):
    relative_bias.t5_relative_bias(jnp.array([0.5, 1.0]), jnp.arange(3), jnp.zeros((32, 2)), bidirectional=True)
