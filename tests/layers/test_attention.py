"""Properties of the MultiHeadAttention layer: equivariance, causality, cross-attention, caches, validation.

Speed: eager JAX compiles every op for every new shape, which is slow on a loaded 2-core box, so
inputs are numpy, layers are built once per configuration and every pass runs under one jit.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import helpers
from xattn_jax.layers.attention import KVCache, MultiHeadAttention
from xattn_jax.layers.rotary import RotarySpec
from xattn_jax.ops import masks as masks_lib


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def _layer(num_heads=4, in_features=16, kv_features=None, seed=0, **options):
  return MultiHeadAttention(num_heads, in_features, kv_features, rngs=nnx.Rngs(seed), **options)


@functools.partial(nnx.jit, static_argnames=("method", "is_causal", "deterministic"))
def _run(layer, *args, method="__call__", is_causal=None, deterministic=None, **kwargs):
  """layer.method(*args, **kwargs) under jit; the static flags are passed only when given."""
  for name, flag in (("is_causal", is_causal), ("deterministic", deterministic)):
    if flag is not None:
      kwargs[name] = flag
  return getattr(layer, method)(*args, **kwargs)


def _decode_in_pieces(layer, x, prompt_length, max_length):
  """Pre-fills x[:, :prompt_length] then feeds the rest one token at a time."""
  cache = layer.init_cache(x.shape[0], max_length)
  out, cache = _run(layer, x[:, :prompt_length], cache, method="extend")
  outs = [out]
  for i in range(prompt_length, x.shape[1]):
    out, cache = _run(layer, x[:, i:i + 1], cache, method="extend")
    outs.append(out)
  return jnp.concatenate(outs, axis=1), cache


@settings(max_examples=4, deadline=None)
@given(length=st.sampled_from([3, 6]), seed=st.integers(0, 2**16))
def test_self_attention_without_positions_is_permutation_equivariant(length, seed):
  layer = _layer()
  x = _normal(seed, (2, length, 16))
  permutation = np.random.default_rng(seed).permutation(length)
  np.testing.assert_allclose(_run(layer, x[:, permutation]), _run(layer, x)[:, permutation], atol=1e-5)


def test_rotary_self_attention_is_not_permutation_equivariant():
  layer = _layer(rotary=RotarySpec())
  x = _normal(1, (2, 6, 16))
  permutation = np.array([1, 0, 2, 3, 5, 4])
  assert not np.allclose(_run(layer, x[:, permutation]), _run(layer, x)[:, permutation], atol=1e-3)


def test_causal_output_is_unchanged_except_last_when_last_token_changes():
  layer = _layer(rotary=RotarySpec())
  x = _normal(2, (2, 6, 16))
  changed = x.copy()
  changed[:, -1] = _normal(3, (2, 16))
  before, after = _run(layer, x, is_causal=True), _run(layer, changed, is_causal=True)
  np.testing.assert_array_equal(before[:, :-1], after[:, :-1])
  assert np.all(np.abs(before[:, -1] - after[:, -1]).max(axis=-1) > 1e-4)


def test_causal_gradient_of_output_wrt_later_input_is_exactly_zero():
  layer = _layer(num_kv_heads=2)
  x = _normal(4, (1, 6, 16))
  # jacobian[t, f, s, g] = d out[0, t, f] / d x[0, s, g]
  jacobian = nnx.jit(lambda layer, x: jax.jacrev(lambda x: layer(x, is_causal=True)[0])(x)[:, :, 0])(layer, x)
  influence = np.abs(np.asarray(jacobian)).sum(axis=(1, 3))  # [t, s]
  assert np.all(influence[np.triu_indices(6, k=1)] == 0.0)
  assert np.all(influence[np.tril_indices(6)] > 0.0)


@pytest.mark.parametrize("kv_features", [64, 256])
def test_cross_attention_returns_one_row_per_query_whatever_the_keys(kv_features):
  layer = _layer(kv_features=kv_features)
  for kv_length in (1, 9):
    chex.assert_shape(_run(layer, _normal(5, (2, 6, 16)), _normal(6, (2, kv_length, kv_features))), (2, 6, 16))


def test_cross_attention_weight_rows_sum_to_one():
  layer = _layer(kv_features=24)
  weights = _run(layer, _normal(7, (2, 6, 16)), _normal(8, (2, 9, 24)), method="attention_weights")
  chex.assert_shape(weights, (2, 4, 6, 9))
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)


def test_cross_attention_ignores_padded_keys():
  layer = _layer(kv_features=24)
  x_q, x_kv = _normal(9, (2, 6, 16)), _normal(10, (2, 9, 24))
  mask = masks_lib.padding_mask(np.arange(9)[None, :] < np.array([[9], [6]]))  # item 1: last 3 keys padded
  changed = x_kv.copy()
  changed[1, 6:] = _normal(11, (3, 24))
  np.testing.assert_array_equal(_run(layer, x_q, x_kv, mask=mask), _run(layer, x_q, changed, mask=mask))
  weights = _run(layer, x_q, x_kv, mask=mask, method="attention_weights")
  assert np.all(weights[1, :, :, 6:] == 0.0)


def test_masks_of_lower_rank_broadcast_as_in_the_op():
  layer = _layer(kv_features=24)
  x_q, x_kv = _normal(9, (2, 6, 16)), _normal(10, (2, 9, 24))
  keys = np.arange(9) < 7  # [kv_len]: the same key mask for every row
  full = _run(layer, x_q, x_kv, mask=jnp.asarray(keys)[None, None, None, :])
  np.testing.assert_array_equal(_run(layer, x_q, x_kv, mask=jnp.asarray(keys)), full)
  np.testing.assert_array_equal(_run(layer, x_q, x_kv, mask=jnp.asarray(np.tile(keys, (6, 1)))), full)


def test_call_with_memory_equals_attend_to_projected_memory():
  layer = _layer(kv_features=24, num_kv_heads=2)
  x_q, x_kv = _normal(12, (2, 6, 16)), _normal(13, (2, 9, 24))
  attend = nnx.jit(lambda layer, x_q, x_kv: layer.attend(x_q, layer.project_memory(x_kv)))
  np.testing.assert_array_equal(_run(layer, x_q, x_kv), attend(layer, x_q, x_kv))


@pytest.mark.parametrize("rotary", [None, RotarySpec(), RotarySpec(layout="interleaved")])
def test_cached_decode_equals_full_causal_pass(rotary):
  layer = _layer(num_kv_heads=2, rotary=rotary)
  x = _normal(14, (2, 6, 16))
  decoded, cache = _decode_in_pieces(layer, x, prompt_length=3, max_length=8)
  np.testing.assert_allclose(decoded, _run(layer, x, is_causal=True), atol=1e-5)
  assert int(cache.index) == 6


def test_cached_prefill_with_key_padding_equals_full_pass_with_padding():
  layer = _layer(rotary=RotarySpec())
  x = _normal(15, (2, 6, 16))
  valid = np.array([[True] * 6, [False, False] + [True] * 4])  # item 1 left-padded by 2
  full = _run(layer, x, mask=masks_lib.padding_mask(valid), is_causal=True)
  cache_valid = np.pad(valid, ((0, 0), (0, 2)), constant_values=True)  # [b, max_length]
  out, _ = _run(layer, x, layer.init_cache(2, 8), mask=masks_lib.padding_mask(cache_valid), method="extend")
  np.testing.assert_allclose(out, full, atol=1e-5)


def test_extend_past_capacity_raises_with_concrete_index():
  layer = _layer()
  full_cache = KVCache(**{**vars(layer.init_cache(2, 8)), "index": jnp.array(5, jnp.int32)})
  with pytest.raises(ValueError, match="max_length=8"):
    layer.extend(_normal(16, (2, 6, 16)), full_cache)


def test_extend_past_capacity_under_jit_returns_nan():
  layer = _layer()
  cache = layer.init_cache(2, 8)
  out, cache = _run(layer, _normal(17, (2, 6, 16)), cache, method="extend")
  assert np.all(np.isfinite(out))
  out, _ = _run(layer, _normal(18, (2, 6, 16)), cache, method="extend")
  assert np.all(np.isnan(out))


def test_a_beam_cache_extended_past_capacity_under_jit_returns_nan():
  # The beam layout's write clamps as the plain one's would: under jit, the step past capacity is NaN, not a
  # plausible output over an overwritten slot.
  layer = _layer()
  _, cache = _run(layer, _normal(19, (2, 4, 16)), layer.init_cache(2, 5), method="extend")
  cache = cache.expand_beams(3)
  out, cache = _run(layer, _normal(20, (6, 1, 16)), cache, method="extend")
  assert np.all(np.isfinite(out)) and int(cache.index) == 5
  out, _ = _run(layer, _normal(21, (6, 1, 16)), cache, method="extend")
  assert np.all(np.isnan(out))


def test_init_cache_is_empty_with_declared_shapes():
  cache = _layer(num_kv_heads=2).init_cache(3, 5, dtype=jnp.bfloat16)
  assert isinstance(cache, KVCache)
  chex.assert_shape([cache.keys, cache.values], (3, 2, 5, 4))  # [b, kv_heads, max_length, h]
  assert cache.keys.dtype == jnp.bfloat16 and int(cache.index) == 0


@pytest.mark.parametrize("implementation", [None, "chunked"])
def test_a_decode_step_reads_the_heads_major_cache_without_a_transposed_copy(implementation):
  layer = _layer(num_kv_heads=2, implementation=implementation)
  cache = layer.init_cache(3, 40)  # [b, kv_heads, max_length, h] = [3, 2, 40, 4]
  graphdef, state = nnx.split(layer)
  step = jax.jit(lambda state, x, cache: nnx.merge(graphdef, state).extend(x, cache))
  compiled = step.lower(state, _normal(0, (3, 1, 16)), cache).compile().as_text()
  # The advanced cache is written in place or copied whole in its own layout; no other cache-sized array.
  assert helpers.full_size_relayouts(compiled, cache.keys.size, {cache.keys.shape}) == []


def test_jit_and_grad_do_not_retrace_on_second_call():
  graphdef, params, rest = nnx.split(_layer(kv_features=24), nnx.Param, ...)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def loss_grad(params, x_q, x_kv):
    return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x_q, x_kv) ** 2))(params)

  for seed in (21, 22):
    grads = loss_grad(params, _normal(seed, (2, 6, 16)), _normal(seed + 1, (2, 9, 24)))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_compute_dtype_is_bfloat16_while_params_stay_float32():
  layer = _layer(dtype=jnp.bfloat16)
  assert _run(layer, _normal(23, (2, 6, 16))).dtype == jnp.bfloat16
  assert layer.query.kernel[...].dtype == jnp.float32


def test_params_carry_logical_axis_names():
  specs = nnx.get_partition_spec(nnx.state(_layer(kv_features=24), nnx.Param))
  assert tuple(specs["query"]["kernel"].get_value()) == ("embed", "heads")
  assert tuple(specs["key"]["kernel"].get_value()) == ("embed", "kv")
  assert tuple(specs["out"]["kernel"].get_value()) == ("heads", "embed")


def test_attention_dropout_is_active_only_when_not_deterministic():
  layer = MultiHeadAttention(4, 16, dropout_rate=0.5, rngs=nnx.Rngs(0))
  x = _normal(24, (2, 6, 16))
  np.testing.assert_allclose(_run(layer, x), _run(_layer(), x), atol=1e-6)  # same init seed, no dropout
  assert not np.allclose(_run(layer, x, deterministic=False), _run(layer, x), atol=1e-4)


@pytest.mark.parametrize("options, argument", [
    (dict(num_heads=4, in_features=16, num_kv_heads=3), "num_kv_heads"),
    (dict(num_heads=3, in_features=16), "in_features"),
    (dict(num_heads=4, in_features=16, rotary=RotarySpec(rotary_dim=3)), "rotary_dim"),
    (dict(num_heads=4, in_features=20, rotary=RotarySpec()), "rotary_dim"),
    (dict(num_heads=4, in_features=16, dropout_rate=1.0), "dropout_rate"),
    (dict(num_heads=4, in_features=16, implementation="flash"), "implementation"),
])
def test_bad_construction_raises_value_error_naming_argument(options, argument):
  with pytest.raises(ValueError, match=argument):
    MultiHeadAttention(rngs=nnx.Rngs(0), **options)


def test_unknown_rotary_kind_raises_value_error_naming_kind():
  with pytest.raises(ValueError, match="kind"):
    RotarySpec(kind="alibi")


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_rotary_scaling_factor_must_be_positive_when_built(factor):
  with pytest.raises(ValueError, match="scaling_factor"):
    RotarySpec(scaling="linear", scaling_factor=factor)


@pytest.mark.parametrize("base", [0.0, -10000.0])
def test_rotary_base_must_be_positive_when_built(base):
  # A layer with such a spec returned NaN everywhere: base ** (-2i/d) is inf or NaN.
  with pytest.raises(ValueError, match=f"RotarySpec: base must be a finite number > 0, got base={base}"):
    RotarySpec(base=base)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(x_q=_normal(0, (2, 6, 12))), "x_q"),
    (dict(x_kv=_normal(1, (2, 9, 16))), "x_kv"),
    (dict(mask=np.ones((2, 1, 6, 4), bool)), "mask"),
    (dict(mask=np.ones((2, 1, 1, 9), np.float32)), "mask"),
    (dict(bias=np.ones((7, 9), np.float32)), "bias"),  # q_len is 6
    # Named by dot_product_attention with the layer's rank-4 copy, bias[1, 1, 6, 9], before.
    (dict(bias=np.ones((6, 9), np.int32)), "MultiHeadAttention: bias must be floating point, got dtype int32"),
])
def test_bad_inputs_raise_value_error_naming_argument(kwargs, argument):
  kwargs = {"x_q": _normal(0, (2, 6, 16)), "x_kv": _normal(1, (2, 9, 24)), **kwargs}
  with pytest.raises(ValueError, match=argument):
    _run(_layer(kv_features=24), **kwargs)


def test_a_memory_of_another_batch_is_refused_by_the_full_pass():
  """x_q of 4 rows and x_kv of 2 ran as attend's grouped rows (query rows 0-1 read memory row 0, as a beam search's
  beams of one source do): a batch mismatch gave a result and no error."""
  with pytest.raises(ValueError, match=r"x_kv must have x_q's batch 4, got x_kv \[2, 9, 24\]"):
    _run(_layer(kv_features=24), x_q=_normal(0, (4, 6, 16)), x_kv=_normal(1, (2, 9, 24)))
  with pytest.raises(ValueError, match="x_kv must have x_q's batch 4"):
    _layer(kv_features=24).attention_weights(_normal(0, (4, 6, 16)), _normal(1, (2, 9, 24)))


def test_extend_with_no_token_raises_naming_x():
  layer = _layer()
  with pytest.raises(ValueError, match=r"extend: x must hold at least one token, got x\[2, 0, 16\]"):
    layer.extend(np.zeros((2, 0, 16), np.float32), layer.init_cache(2, 8))


def test_extend_with_cache_of_other_batch_raises_value_error_naming_cache():
  layer = _layer()
  with pytest.raises(ValueError, match="cache"):
    layer.extend(_normal(0, (2, 6, 16)), layer.init_cache(3, 8))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(mask=np.ones((2, 1, 1, 4), bool)),
     r"extend: mask must broadcast to \[batch, heads, q_len, max_length\] = \[2, 4, 6, 10\]"),
    (dict(mask=np.ones((2, 1, 1, 10), np.float32)), "extend: mask must be boolean"),
    (dict(bias=np.ones((2, 4, 1, 8), np.float32)),
     r"extend: bias must broadcast to \[batch, heads, q_len, max_length\] = \[2, 4, 6, 10\]"),
])
def test_extend_with_a_bad_mask_or_bias_names_extend_and_max_length(kwargs, needle):
  layer = _layer()
  with pytest.raises(ValueError, match=needle):
    layer.extend(_normal(0, (2, 6, 16)), layer.init_cache(2, 10), **kwargs)


@pytest.mark.parametrize("call, argument", [("call", "query_positions"), ("call", "key_positions"),
                                            ("extend", "positions")])
def test_an_attention_without_rotary_refuses_positions_it_would_ignore(call, argument):
  """Positions handed to a layer with rotary=None changed nothing, without a word."""
  layer, x, positions = _layer(), _normal(0, (2, 6, 16)), np.arange(6)[None]
  with pytest.raises(ValueError, match=rf"{argument} given to an attention without a rotary encoding"):
    if call == "call":
      layer(x, **{argument: positions})
    else:
      layer.extend(x, layer.init_cache(2, 10), positions=positions)


@pytest.mark.parametrize("kind, call, needle", [
    ("rope", "call", r"MultiHeadAttention: query_positions do not fit the \[batch, length\] = \[2, 6\]"),
    ("rope", "extend", r"MultiHeadAttention.extend: positions do not fit the \[batch, length\] = \[2, 6\]"),
    ("rope_2d", "extend", r"MultiHeadAttention.extend: rotary kind 'rope_2d' needs explicit positions "),
    # Self-attention's keys take query_positions when no key_positions are given: the errors named those.
    ("rope", "self", r"MultiHeadAttention: query_positions do not fit the \[batch, length\] = \[2, 6\]"),
    ("rope_2d", "self", r"MultiHeadAttention: rotary kind 'rope_2d' needs explicit query_positions "),
])
def test_rotary_position_errors_name_the_layers_own_argument(kind, call, needle):
  layer = MultiHeadAttention(4, 16, rotary=RotarySpec(kind=kind), rngs=nnx.Rngs(0))
  x, wrong = _normal(0, (2, 6, 16)), np.arange(5)[None] if kind == "rope" else None
  with pytest.raises(ValueError, match=needle):
    if call == "call":
      layer(x, query_positions=wrong, key_positions=np.arange(6)[None])
    elif call == "self":
      layer(x, query_positions=wrong)
    else:
      layer.extend(x, layer.init_cache(2, 10), positions=wrong)


def test_sizes_may_be_numpy_integers_and_are_stored_as_python_ints():
  layer = MultiHeadAttention(np.int64(4), np.int32(16), num_kv_heads=np.int64(2), rngs=nnx.Rngs(0))
  assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.in_features) == (4, 2, 4, 16)
  assert all(type(size) is int for size in (layer.num_heads, layer.num_kv_heads, layer.head_dim))
  with pytest.raises(ValueError, match="num_heads must be a positive int, got num_heads=True"):
    MultiHeadAttention(True, 16, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("batch_size, max_length", [(2, 3.5), (0, 4), (2, -1)])
def test_init_cache_refuses_non_positive_or_non_int_sizes(batch_size, max_length):
  with pytest.raises(ValueError, match="init_cache: batch_size and max_length must be positive ints"):
    _layer().init_cache(batch_size, max_length)


@pytest.mark.parametrize("beam_size", [0, -1, 2.0])
def test_expand_beams_refuses_a_beam_size_that_is_not_a_positive_int(beam_size):
  # 0 built an empty beam cache without a word, -1 failed in a broadcast naming neither.
  with pytest.raises(ValueError, match=f"KVCache.expand_beams: beam_size must be a positive int, got "
                                       f"beam_size={beam_size}"):
    _layer().init_cache(2, 4).expand_beams(beam_size)


@pytest.mark.parametrize("parent, got", [([[0, 1], [1, 0]], r"int32\[2, 2\]"),
                                         (np.zeros((2, 3), np.float32), r"float32\[2, 3\]")])
def test_reorder_beams_refuses_a_parent_that_is_not_int_batch_by_beams(parent, got):
  # A list failed with an AttributeError (no .shape); float parents were truncated to slots silently.
  cache = _layer().init_cache(2, 4).expand_beams(3)
  with pytest.raises(ValueError, match=r"KVCache.reorder_beams: parent must be int \[2, 3\], got " + got):
    cache.reorder_beams(parent)


def test_init_cache_refuses_a_dtype_that_is_not_floating_point():
  # An int32 cache took every projected key and value truncated to ints, and decoded on without a word.
  with pytest.raises(ValueError, match="init_cache: dtype must be floating point, got dtype=int32"):
    _layer().init_cache(2, 4, dtype=jnp.int32)


def _beam_steps(layer, prefix, steps, parents, mask, bias, by_index):
  """Pre-fills prefix [b, p, 16], expands to beams, then one token per beam per step, reordering by
  parents[i] [b, beams] after each step: by index (beam layout) or by copying the cache rows."""
  batch, beams = parents.shape[1:]
  _, cache = _run(layer, prefix, layer.init_cache(batch, 8), method="extend")
  rows = (np.arange(batch)[:, None] * beams + parents).reshape(len(parents), -1)  # -> [steps, b * beams]
  if by_index:
    cache = cache.expand_beams(beams)
  else:
    cache = jax.tree.map(lambda x: jnp.repeat(x, beams, axis=0) if jnp.ndim(x) else x, cache)
  outs = []
  for i, x in enumerate(steps):
    out, cache = _run(layer, x, cache, mask=mask, bias=bias, method="extend")
    outs.append(out)
    cache = cache.reorder_beams(jnp.asarray(parents[i])) if by_index else jax.tree.map(
        lambda a, r=rows[i]: jnp.take(a, r, axis=0) if jnp.ndim(a) else a, cache)
  return np.concatenate(outs, axis=1)


def test_beam_cache_reordered_by_index_equals_cache_rows_copied_per_beam():
  layer = _layer(num_kv_heads=2, rotary=RotarySpec())
  batch, beams, prompt = 2, 3, 2
  parents = np.random.default_rng(3).integers(0, beams, (4, batch, beams))
  steps = [_normal(20 + i, (batch * beams, 1, 16)) for i in range(4)]
  valid = np.ones((batch * beams, 8), bool)
  valid[-beams:, 0] = False  # the last example's first prompt token is padding, in all its beams
  mask = masks_lib.padding_mask(valid)  # -> [b * beams, 1, 1, 8]
  bias = _normal(9, (batch * beams, 4, 1, 8))  # e.g. a relative position bias
  args = (layer, _normal(19, (batch, prompt, 16)), steps, parents, mask, bias)
  np.testing.assert_allclose(_beam_steps(*args, by_index=True), _beam_steps(*args, by_index=False), atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_query_rows_sharing_a_memory_row_equal_attending_to_it_repeated(transposed):
  layer = _layer(num_kv_heads=2, kv_features=24)
  memory_cache = _run(layer, _normal(30, (2, 5, 24)), method="project_memory")
  x_q = _normal(31, (6, 2, 16))  # 3 query rows per memory row
  valid = np.array([[True] * 5, [True, True, True, False, False]])
  shared = memory_cache.transpose_keys() if transposed else memory_cache
  repeated = jax.tree.map(lambda x: jnp.repeat(x, 3, axis=0), memory_cache)
  out = _run(layer, x_q, shared, mask=masks_lib.padding_mask(valid), method="attend")
  expected = _run(layer, x_q, repeated, mask=masks_lib.padding_mask(np.repeat(valid, 3, axis=0)), method="attend")
  np.testing.assert_allclose(out, expected, atol=1e-5)


def test_a_nan_key_read_through_transposed_keys_gives_nan_not_zeros():
  """As `ops.attention`: a query seeing a NaN key is NaN, not a query that sees no key (zeros)."""
  layer = _layer(num_kv_heads=2, kv_features=24)
  memory_cache = _run(layer, _normal(30, (2, 5, 24)), method="project_memory")
  shared = memory_cache.replace(keys=memory_cache.keys.at[1, :, 0].set(jnp.nan)).transpose_keys()
  out = np.asarray(_run(layer, _normal(31, (6, 2, 16)), shared, mask=masks_lib.padding_mask(np.ones((2, 5), bool)),
                        method="attend"))  # 3 query rows per memory row
  assert np.all(np.isfinite(out[:3])) and np.all(np.isnan(out[3:]))


def test_a_cache_head_is_refused_past_the_capacity_and_merged_back_only_into_its_own_cache():
  cache = MultiHeadAttention(2, 8, rngs=nnx.Rngs(0)).init_cache(2, 6)
  with pytest.raises(ValueError, match=r"KVCache.head: n must be an int in \[1, 6\]"):
    cache.head(7)
  head = cache.head(4)
  assert head.keys.shape == (2, 2, 4, 4) and cache.with_head(head).keys.shape == (2, 2, 6, 4)
  with pytest.raises(ValueError, match="head must be a head"):
    head.with_head(cache)


def test_beam_cache_attention_scales_half_precision_scores_in_float32():
  """head_dim 24 (a scale bfloat16 cannot hold): the beam cache's attention multiplied bfloat16 queries by it, one
  more rounding of every score, 0.05 off the float32 attention of the same inputs at scores ~60."""
  from xattn_jax.layers.attention import _attention_keys_transposed
  from xattn_jax.ops import attention as attention_ops
  rng = np.random.default_rng(4)
  q, keys, values = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                     for shape in ((2, 3, 4, 24), (2, 2, 24, 9), (2, 2, 9, 24)))  # [b, beams, heads, h], 9 slots
  q = (q * 18).astype(jnp.bfloat16)  # scores up to ~60
  mask = jnp.asarray(rng.random((2, 1, 3, 9)) < 0.8)
  out = _attention_keys_transposed(q, keys, values, mask, None)
  expected = attention_ops.dot_product_attention(  # beams as queries; keys back to [b, kv_heads, slots, h]
      q.astype(jnp.float32), jnp.swapaxes(keys, 2, 3).astype(jnp.float32), values.astype(jnp.float32), mask=mask,
      kv_layout="bksh", implementation="dense")
  assert out.dtype == jnp.bfloat16
  atol = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(values.astype(jnp.float32)).max())
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=atol)


def test_beam_cache_attention_gives_a_query_that_sees_no_slot_zeros_and_finite_gradients():
  """The docstring's "returns zeros, as in ops.attention": a beam whose mask hides every slot."""
  from xattn_jax.layers.attention import _attention_keys_transposed
  rng = np.random.default_rng(5)
  q, keys, values = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                     for shape in ((1, 2, 2, 8), (1, 1, 8, 4), (1, 1, 4, 8)))  # 2 beams, 4 slots
  mask = jnp.asarray([[True, False, True, True], [False] * 4])[None, None]  # beam 1 sees nothing
  loss = lambda *args: jnp.sum(_attention_keys_transposed(*args, mask, None).astype(jnp.float32) ** 2)
  out = _attention_keys_transposed(q, keys, values, mask, None)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, keys, values)
  np.testing.assert_array_equal(np.asarray(out[0, 1], np.float32), 0.0)
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
