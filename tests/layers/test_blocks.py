"""Properties of the blocks: cached decoding, memory projected once, gating, pooling, scan over stacks."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xattn_jax.layers import blocks
from xattn_jax.layers.attention import MultiHeadAttention
from xattn_jax.layers.rotary import RotarySpec
from xattn_jax.ops import attention as attention_ops
from xattn_jax.ops import masks as masks_lib

FEATURES, MEMORY_FEATURES, HEADS, MLP_FEATURES = 16, 24, 4, 32


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def _decoder(norm="pre", seed=0):
  return blocks.DecoderBlock(FEATURES, HEADS, MLP_FEATURES, memory_features=MEMORY_FEATURES, norm=norm,
                             rotary=RotarySpec(), rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("rate", [1.5, -0.1, 1.0])
def test_blocks_refuse_a_dropout_rate_outside_zero_to_one(rate):
  """EncoderBlock(dropout_rate=1.5) built, and in training its dropout zeroed every activation (the ViT, Perceiver,
  Q-Former and connectors build on these blocks; the LM and Translator checked their own rates)."""
  with pytest.raises(ValueError, match=rf"dropout_rate must be in \[0, 1\), got dropout_rate={rate}"):
    blocks.EncoderBlock(FEATURES, HEADS, MLP_FEATURES, dropout_rate=rate, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dropout_rate must be in"):
    blocks.make_mlp("mlp", FEATURES, MLP_FEATURES, dropout_rate=rate, rngs=nnx.Rngs(0))


def test_a_decoder_block_refuses_a_memory_of_another_batch():
  """DecoderBlock(x[2, ...], memory[1, ...]) read memory row 0 for both rows of x, without a word."""
  x, memory = _normal(0, (2, 5, FEATURES)), _normal(1, (1, 7, MEMORY_FEATURES))
  with pytest.raises(ValueError, match=r"DecoderBlock: memory must have x's batch 2, got memory\[1, 7, "):
    _decoder()(x, memory)
  with pytest.raises(ValueError, match=r"DecoderBlock.cross_attention_weights: memory must have x's batch 2"):
    _decoder().cross_attention_weights(x, memory)


@pytest.mark.parametrize("argument, value, message", [
    ("self_mask", np.ones((2, 1, 1, 5), bool), r"self_mask must broadcast to .* got self_mask\[2, 1, 1, 5\]"),
    ("self_mask", np.ones((2, 1, 1, 4), np.float32), "self_mask must be boolean"),
    ("self_bias", np.ones((2, 1, 1, 4), bool), "self_bias must be floating point"),
    ("memory_mask", np.ones((2, 1, 1, 6), bool), r"memory_mask must broadcast to .* got memory_mask\[2, 1, 1, 6\]"),
])
def test_decoder_block_decode_errors_name_its_own_arguments(argument, value, message):
  """A bad self_mask was called `mask` (and from MultiHeadAttention.extend), an argument decode does not have."""
  cache = _decoder().init_cache(_normal(1, (2, 7, MEMORY_FEATURES)), 4)
  with pytest.raises(ValueError, match=rf"^DecoderBlock.decode: {message}"):
    _decoder().decode(_normal(0, (2, 1, FEATURES)), cache, **{argument: value})


@nnx.jit
def _decode(block, x, cache, memory_mask):
  return block.decode(x, cache, memory_mask=memory_mask)


@nnx.jit
def _decoder_pass(block, x, memory, memory_mask):
  return block(x, memory, memory_mask=memory_mask)


def _memory_and_mask():
  memory = _normal(1, (2, 5, MEMORY_FEATURES))
  return memory, masks_lib.padding_mask(np.arange(5)[None] < np.array([[5], [3]]))  # item 1: 2 padded rows


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_decoder_block_cached_decode_equals_full_pass(norm):
  block, (memory, memory_mask) = _decoder(norm), _memory_and_mask()
  x = _normal(2, (2, 6, FEATURES))
  cache = block.init_cache(memory, max_length=8)
  out, cache = _decode(block, x[:, :3], cache, memory_mask)  # pre-fill the prompt
  outs = [out]
  for i in range(3, 6):
    out, cache = _decode(block, x[:, i:i + 1], cache, memory_mask)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), _decoder_pass(block, x, memory, memory_mask), atol=1e-5)


def test_decoder_memory_is_projected_once_per_memory(monkeypatch):
  # Only the cross-attention key and value kernels read MEMORY_FEATURES-wide inputs.
  memory_projections = []
  linear_call = nnx.Linear.__call__

  def counting_call(self, x):
    if self.in_features == MEMORY_FEATURES:
      memory_projections.append(x.shape)
    return linear_call(self, x)

  monkeypatch.setattr(nnx.Linear, "__call__", counting_call)
  block, (memory, memory_mask) = _decoder(), _memory_and_mask()
  cache = block.init_cache(memory, max_length=8)
  assert len(memory_projections) == 2  # keys and values
  step = nnx.jit(lambda block, x, cache: block.decode(x, cache, memory_mask=memory_mask))  # traced afresh
  for i in range(3):
    _, cache = step(block, _normal(i, (2, 1, FEATURES)), cache)
  assert len(memory_projections) == 2


def test_decoder_output_ignores_padded_memory_rows():
  block, (memory, memory_mask) = _decoder(), _memory_and_mask()
  x = _normal(3, (2, 6, FEATURES))
  changed = memory.copy()
  changed[1, 3:] = _normal(4, (2, MEMORY_FEATURES))
  np.testing.assert_array_equal(_decoder_pass(block, x, memory, memory_mask),
                                _decoder_pass(block, x, changed, memory_mask))


def _record_attention_inputs(monkeypatch):
  """Records (q, keys, mask) of every MultiHeadAttention._attend_heads call of the full passes."""
  calls = []
  attend_heads = MultiHeadAttention._attend_heads

  def recording(self, q, keys, values, *, mask, bias, is_causal, deterministic):
    # The layer hands its kernel heads-major keys [b, k, s, h]; recorded as [b, s, k, h].
    calls.append((q, keys.transpose(0, 2, 1, 3), mask, bias, is_causal))
    return attend_heads(self, q, keys, values, mask=mask, bias=bias, is_causal=is_causal,
                        deterministic=deterministic)

  monkeypatch.setattr(MultiHeadAttention, "_attend_heads", recording)
  return calls


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_decoder_cross_attention_weights_are_the_probabilities_of_the_full_pass(monkeypatch, norm):
  block, (memory, memory_mask) = _decoder(norm), _memory_and_mask()
  x = _normal(8, (2, 6, FEATURES))
  calls = _record_attention_inputs(monkeypatch)
  block(x, memory, memory_mask=memory_mask)
  (q, keys, mask, _, _), = [c for c in calls if c[1].shape[1] == memory.shape[1]]  # the cross-attention
  weights = block.cross_attention_weights(x, memory, memory_mask=memory_mask)
  chex.assert_shape(weights, (2, HEADS, 6, 5))
  np.testing.assert_allclose(weights, attention_ops.attention_weights(q, keys, mask=mask), atol=1e-6)
  assert (np.asarray(weights[1, :, :, 3:]) == 0).all()  # padded memory rows


def test_encoder_attention_weights_are_the_probabilities_of_the_full_pass(monkeypatch):
  block = blocks.EncoderBlock(FEATURES, HEADS, MLP_FEATURES, rngs=nnx.Rngs(0))
  x, mask = _normal(9, (2, 6, FEATURES)), masks_lib.padding_mask(np.arange(6)[None] < np.array([[6], [4]]))
  calls = _record_attention_inputs(monkeypatch)
  block(x, mask=mask)
  (q, keys, recorded_mask, _, _), = calls
  np.testing.assert_allclose(block.attention_weights(x, mask=mask),
                             attention_ops.attention_weights(q, keys, mask=recorded_mask), atol=1e-6)


def test_attention_weights_reject_a_stream_of_the_wrong_width():
  block, (memory, _) = _decoder(), _memory_and_mask()
  with pytest.raises(ValueError, match=r"memory must be \[batch, length, 24\], got memory\[2, 5, 16\]"):
    block.cross_attention_weights(_normal(0, (2, 6, FEATURES)), memory[..., :FEATURES])


def test_post_norm_encoder_output_rows_are_normalized():
  block = blocks.EncoderBlock(FEATURES, HEADS, MLP_FEATURES, norm="post", rngs=nnx.Rngs(0))
  out = nnx.jit(lambda block, x: block(x))(block, _normal(5, (2, 6, FEATURES)))
  np.testing.assert_allclose(out.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(out.var(-1), 1.0, atol=1e-3)


def test_encoder_block_ignores_padded_tokens():
  block = blocks.EncoderBlock(FEATURES, HEADS, MLP_FEATURES, rngs=nnx.Rngs(0))
  run = nnx.jit(lambda block, x, mask: block(x, mask=mask))
  x, mask = _normal(6, (2, 6, FEATURES)), masks_lib.padding_mask(np.arange(6)[None] < np.array([[6], [4]]))
  changed = x.copy()
  changed[1, 4:] = _normal(7, (2, FEATURES))
  np.testing.assert_array_equal(run(block, x, mask)[1, :4], run(block, changed, mask)[1, :4])


def test_gated_cross_attention_block_is_identity_at_init_and_not_after_gates_open():
  block = blocks.GatedCrossAttentionBlock(FEATURES, MEMORY_FEATURES, HEADS, MLP_FEATURES, rngs=nnx.Rngs(0))
  run = nnx.jit(lambda block, x, memory: block(x, memory))
  x, memory = _normal(8, (2, 6, FEATURES)), _normal(9, (2, 5, MEMORY_FEATURES))
  np.testing.assert_array_equal(run(block, x, memory), x)
  block.attention_residual.gate[...] = jnp.array(0.5)
  assert not np.allclose(run(block, x, memory), x, atol=1e-3)


@functools.cache
def _pooling():
  return blocks.LearnedQueryPooling(3, FEATURES, MEMORY_FEATURES, HEADS, rngs=nnx.Rngs(0))


@nnx.jit
def _pool(pooling, inputs, valid):
  return pooling(inputs, valid=valid)


def test_learned_query_pooling_gives_one_row_per_query_for_any_input_count():
  for num_inputs in (64, 256, 257):
    inputs = _normal(num_inputs, (2, num_inputs, MEMORY_FEATURES))
    chex.assert_shape(_pool(_pooling(), inputs, np.ones((2, num_inputs), bool)), (2, 3, FEATURES))


def test_learned_query_pooling_is_invariant_to_permuting_the_inputs():
  inputs, valid = _normal(10, (2, 64, MEMORY_FEATURES)), np.arange(64)[None] < np.array([[64], [50]])
  permutation = np.random.default_rng(0).permutation(64)
  np.testing.assert_allclose(_pool(_pooling(), inputs[:, permutation], valid[:, permutation]),
                             _pool(_pooling(), inputs, valid), atol=1e-5)


def test_learned_query_pooling_ignores_invalid_inputs():
  inputs, valid = _normal(11, (2, 64, MEMORY_FEATURES)), np.arange(64)[None] < np.array([[64], [50]])
  changed = inputs.copy()
  changed[1, 50:] = _normal(12, (14, MEMORY_FEATURES))
  np.testing.assert_array_equal(_pool(_pooling(), inputs, valid), _pool(_pooling(), changed, valid))


def test_learned_queries_start_with_standard_deviation_002():
  queries = blocks.LearnedQueryPooling(256, FEATURES, MEMORY_FEATURES, HEADS, rngs=nnx.Rngs(0)).queries[...]
  assert 0.018 < float(queries.std()) < 0.022 and abs(float(queries.mean())) < 0.002


def test_stacked_decoder_blocks_decode_under_nnx_scan_like_the_full_pass():
  @nnx.vmap(in_axes=0, out_axes=0)
  def make_stack(key):
    return blocks.DecoderBlock(FEATURES, HEADS, MLP_FEATURES, memory_features=MEMORY_FEATURES,
                               rotary=RotarySpec(), rngs=nnx.Rngs(key))

  @nnx.jit
  def full_pass(stack, x, memory):
    run = nnx.scan(lambda x, block: (block(x, memory), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    return run(x, stack)[0]

  @nnx.jit
  def decode(stack, x, caches):
    run = nnx.scan(lambda x, block, cache: block.decode(x, cache), in_axes=(nnx.Carry, 0, 0),
                   out_axes=(nnx.Carry, 0))
    return run(x, stack, caches)

  stack = make_stack(jax.random.split(jax.random.key(0), 2))
  memory, x = _normal(13, (2, 5, MEMORY_FEATURES)), _normal(14, (2, 4, FEATURES))
  caches = nnx.vmap(lambda block: block.init_cache(memory, 6), in_axes=0, out_axes=0)(stack)
  chex.assert_shape(caches.self_attention.keys, (2, 2, HEADS, 6, FEATURES // HEADS))  # [layers, b, k, s, h]
  prefill, caches = decode(stack, x[:, :3], caches)
  step, caches = decode(stack, x[:, 3:], caches)
  np.testing.assert_allclose(jnp.concatenate([prefill, step], 1), full_pass(stack, x, memory), atol=1e-5)
  np.testing.assert_array_equal(caches.self_attention.index, [4, 4])


def test_decoder_block_jit_and_grad_do_not_retrace_on_second_call():
  graphdef, params, rest = nnx.split(_decoder(), nnx.Param, ...)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def loss_grad(params, x, memory):
    return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x, memory) ** 2))(params)

  for seed in (15, 16):
    grads = loss_grad(params, _normal(seed, (2, 6, FEATURES)), _normal(seed + 1, (2, 5, MEMORY_FEATURES)))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_mlp_and_norm_choices_are_validated():
  with pytest.raises(ValueError, match="norm"):
    blocks.EncoderBlock(FEATURES, HEADS, MLP_FEATURES, norm="sandwich", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="activation"):
    blocks.MLP(FEATURES, MLP_FEATURES, activation="swish2", rngs=nnx.Rngs(0))


def test_mlp_kernels_carry_logical_axis_names():
  specs = nnx.get_partition_spec(nnx.state(blocks.MLP(FEATURES, MLP_FEATURES, rngs=nnx.Rngs(0)), nnx.Param))
  assert tuple(specs["wi"]["kernel"].get_value()) == ("embed", "mlp")
  assert tuple(specs["wo"]["kernel"].get_value()) == ("mlp", "embed")


@pytest.mark.parametrize("call, needle", [
    (lambda r: blocks.EncoderBlock(32, 4, 64, rngs=r)(jnp.ones((2, 7, 16))), r"EncoderBlock: x must be .*32\]"),
    (lambda r: blocks.DecoderBlock(32, 4, 64, memory_features=24, rngs=r)(jnp.ones((2, 7, 32)), jnp.ones((2, 5, 16))),
     r"DecoderBlock: memory must be .*24\]"),
    (lambda r: blocks.DecoderBlock(32, 4, 64, rngs=r).decode(jnp.ones((2, 1, 8)), None), r"decode: x must be"),
    (lambda r: blocks.CrossAttentionBlock(32, 24, 4, 64, rngs=r)(jnp.ones((2, 7, 32)), jnp.ones((2, 5, 16))),
     r"CrossAttentionBlock: inputs must be"),
    (lambda r: blocks.GatedCrossAttentionBlock(32, 24, 4, 64, rngs=r)(jnp.ones((2, 7, 16)), jnp.ones((2, 5, 24))),
     r"GatedCrossAttentionBlock: x must be"),
])
def test_blocks_name_the_input_of_the_wrong_width(call, needle):
  # Before, LayerNorm failed first with a TypeError about reshaping its scale.
  with pytest.raises(ValueError, match=needle):
    call(nnx.Rngs(0))


def test_learned_query_pooling_takes_valid_as_a_list():
  pool = blocks.LearnedQueryPooling(3, 16, 8, 2, rngs=nnx.Rngs(0))
  inputs = jnp.ones((1, 4, 8))
  np.testing.assert_array_equal(pool(inputs, valid=[[True, True, False, False]]),
                                pool(inputs, valid=jnp.asarray([[True, True, False, False]])))


def test_learned_query_pooling_refuses_valid_that_is_not_bool_naming_it():
  # Named padding_mask, which the caller never called, about a kv_len it never passed.
  with pytest.raises(ValueError, match=r"LearnedQueryPooling: valid must be bool \[1, 4\], got float32\[1, 4\]"):
    _pool(_pooling(), jnp.ones((1, 4, MEMORY_FEATURES)), np.ones((1, 4), np.float32))


@pytest.mark.parametrize("num_queries", [0, 2.5])
def test_learned_query_pooling_refuses_num_queries_that_is_not_a_positive_int(num_queries):
  # 2.5 failed in the initializer with a TypeError about shapes.
  with pytest.raises(ValueError, match=f"num_queries must be a positive int, got num_queries={num_queries}"):
    blocks.LearnedQueryPooling(num_queries, FEATURES, MEMORY_FEATURES, HEADS, rngs=nnx.Rngs(0))


# --- norm types and MLP kinds (the registries the LM reads) -----------------------------------------

def test_rms_norm_is_x_over_its_root_mean_square_times_scale():
  norm = blocks.make_norm("rmsnorm", FEATURES, rngs=nnx.Rngs(0))
  scale = _normal(1, (FEATURES,))
  norm.scale[...] = jnp.asarray(scale)
  x = _normal(2, (2, 3, FEATURES))
  expected = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + norm.epsilon) * scale
  np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-6)


def test_swiglu_is_down_of_silu_gate_times_up():
  mlp = blocks.make_mlp("swiglu", FEATURES, MLP_FEATURES, rngs=nnx.Rngs(0))
  x = _normal(3, (2, 3, FEATURES))
  gate, up, down = (np.asarray(layer.kernel[...]) for layer in (mlp.gate, mlp.up, mlp.down))
  hidden = x @ gate
  expected = (hidden / (1 + np.exp(-hidden)) * (x @ up)) @ down
  np.testing.assert_allclose(mlp(jnp.asarray(x)), expected, rtol=1e-4, atol=1e-5)


def test_every_registered_norm_and_mlp_kind_maps_features_to_features():
  x = jnp.asarray(_normal(4, (2, 3, FEATURES)))
  for norm_type in blocks.NORM_TYPES:
    assert blocks.make_norm(norm_type, FEATURES, rngs=nnx.Rngs(0))(x).shape == x.shape
  for mlp_type in blocks.MLP_TYPES:
    assert blocks.make_mlp(mlp_type, FEATURES, MLP_FEATURES, rngs=nnx.Rngs(0))(x).shape == x.shape


def test_an_unregistered_norm_or_mlp_kind_is_named():
  with pytest.raises(ValueError, match="norm_type='batchnorm'"):
    blocks.make_norm("batchnorm", FEATURES, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="mlp_type='geglu'"):
    blocks.make_mlp("geglu", FEATURES, MLP_FEATURES, rngs=nnx.Rngs(0))
