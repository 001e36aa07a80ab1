"""The two-way attention block and transformer (SAM's mask decoder): permutation, padding, shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import Jitted
from xattn_jax.layers.two_way import TwoWayAttentionBlock, TwoWayTransformer

WIDTH = 16


def _inputs(seed, batch=2, tokens=5, features=12):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (batch, tokens, WIDTH)), jax.random.normal(keys[1], (batch, tokens, WIDTH)),
          jax.random.normal(keys[2], (batch, features, WIDTH)), jax.random.normal(keys[3], (batch, features, WIDTH)))


@pytest.fixture(scope="module")
def transformer():
  return Jitted(TwoWayTransformer(WIDTH, 2, 32, 2, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def block():
  return Jitted(TwoWayAttentionBlock(WIDTH, 2, 32, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("layer", ["block", "transformer"])
def test_tokens_are_invariant_and_image_equivariant_to_permuting_image_features_with_their_positions(
    layer, request):
  module = request.getfixturevalue(layer)
  tokens, token_pe, image, image_pe = _inputs(0)
  order = np.random.default_rng(0).permutation(image.shape[1])
  out_tokens, out_image = module(tokens, image, token_pe=token_pe, image_pe=image_pe)
  perm_tokens, perm_image = module(tokens, image[:, order], token_pe=token_pe, image_pe=image_pe[:, order])
  np.testing.assert_allclose(perm_tokens, out_tokens, atol=1e-5)
  np.testing.assert_allclose(perm_image, out_image[:, order], atol=1e-5)


@pytest.mark.parametrize("features", [1, 7, 40])
def test_one_output_per_token_whatever_the_number_of_image_features(transformer, features):
  tokens, token_pe, image, image_pe = _inputs(1, tokens=4, features=features)
  out_tokens, out_image = transformer(tokens, image, token_pe=token_pe, image_pe=image_pe)
  assert out_tokens.shape == (2, 4, WIDTH) and out_image.shape == (2, features, WIDTH)


def test_padded_tokens_change_no_real_token_and_no_image_feature(transformer):
  tokens, token_pe, image, image_pe = _inputs(2, tokens=3)
  garbage = jax.random.normal(jax.random.key(9), (2, 4, WIDTH)) * 10.0
  padded_tokens = jnp.concatenate([tokens, garbage], axis=1)
  padded_pe = jnp.concatenate([token_pe, -garbage], axis=1)
  valid = jnp.arange(7)[None, :].repeat(2, 0) < 3
  out_tokens, out_image = transformer(tokens, image, token_pe=token_pe, image_pe=image_pe)
  pad_tokens, pad_image = transformer(padded_tokens, image, token_pe=padded_pe, image_pe=image_pe, token_valid=valid)
  np.testing.assert_allclose(pad_tokens[:, :3], out_tokens, atol=1e-5)
  np.testing.assert_allclose(pad_image, out_image, atol=1e-5)


def test_padding_differs_from_attending_to_the_padded_tokens(transformer):
  tokens, token_pe, image, image_pe = _inputs(3, tokens=4)
  valid = jnp.array([[True, True, True, False]] * 2)
  masked, _ = transformer(tokens, image, token_pe=token_pe, image_pe=image_pe, token_valid=valid)
  unmasked, _ = transformer(tokens, image, token_pe=token_pe, image_pe=image_pe)
  assert not np.allclose(masked[:, :3], unmasked[:, :3], atol=1e-4)


@pytest.mark.parametrize("name, change", [("token_pe", lambda x: x[:, :-1]), ("image_pe", lambda x: x[..., :-1])])
def test_mismatched_positional_encodings_raise_naming_them(transformer, name, change):
  tokens, token_pe, image, image_pe = _inputs(4)
  arguments = {"token_pe": token_pe, "image_pe": image_pe}
  arguments[name] = change(arguments[name])
  with pytest.raises(ValueError, match=name):
    transformer(tokens, image, **arguments)


@pytest.mark.parametrize("layer", [TwoWayAttentionBlock, lambda *a, **o: TwoWayTransformer(*a, 1, **o)],
                         ids=["block", "transformer"])
@pytest.mark.parametrize("name, options", [("num_heads", dict(num_heads=0)),
                                           ("cross_attention_downsample", dict(cross_attention_downsample=0))])
def test_zero_heads_or_downsample_raise_naming_them(layer, name, options):
  # Both divided the width: a ZeroDivisionError that named neither.
  arguments = {"num_heads": 2, **options}
  with pytest.raises(ValueError, match=f"TwoWayAttentionBlock: {name} must be a positive int, got {name}=0"):
    layer(WIDTH, arguments.pop("num_heads"), 32, rngs=nnx.Rngs(0), **arguments)


def _sam_attention(attention, q, k, v):
  """SAM's `Attention.forward`: project, split heads, softmax(q k^T / sqrt(head_dim)) v, recombine, project out."""
  split = lambda x, n: x.reshape(x.shape[0], x.shape[1], n, -1)
  q, k, v = (split(attention.query(q), attention.num_heads), split(attention.key(k), attention.num_kv_heads),
             split(attention.value(v), attention.num_kv_heads))
  weights = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1]), axis=-1)
  return attention.out(jnp.einsum("bhts,bshd->bthd", weights, v).reshape(q.shape[0], q.shape[1], -1))


def _sam_block(block, queries, keys, query_pe, key_pe):
  """SAM's `TwoWayAttentionBlock.forward`, line for line (segment_anything/modeling/transformer.py)."""
  if block.skip_first_layer_pe:
    queries = _sam_attention(block.self_attention, queries, queries, queries)
  else:
    q = queries + query_pe
    queries = queries + _sam_attention(block.self_attention, q, q, queries)
  queries = block.norms[0](queries)
  queries = block.norms[1](queries + _sam_attention(block.token_to_image, queries + query_pe, keys + key_pe, keys))
  queries = block.norms[2](queries + block.mlp(queries))
  keys = block.norms[3](keys + _sam_attention(block.image_to_token, keys + key_pe, queries + query_pe, queries))
  return queries, keys


@pytest.mark.parametrize("skip_first_layer_pe", [False, True])
def test_a_block_computes_what_sams_block_computes(skip_first_layer_pe):
  # SAM's first block has no residual around its self-attention: a residual there once made it another model.
  block = TwoWayAttentionBlock(WIDTH, 2, 32, skip_first_layer_pe=skip_first_layer_pe, rngs=nnx.Rngs(3))
  tokens, token_pe, image, image_pe = _inputs(4)
  got = block(tokens, image, token_pe=token_pe, image_pe=image_pe)
  want = _sam_block(block, tokens, image, token_pe, image_pe)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5)
