"""The decoder-only LanguageModel: causality, packing, cached decoding, ragged prompts, hooks."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from xattn_jax.layers import blocks
from xattn_jax.models import lm

VOCAB, D_MODEL, LENGTH = 32, 16, 8
ENCODINGS = lm.position_encodings()


def _options(encoding: str) -> dict:
  """One layer (compiles fast); the other choices alternate over the encodings, so every one is exercised:
  even ones LayerNorm / MLP / tied / full heads, odd ones RMSNorm / SwiGLU / untied / one kv head (MQA)."""
  odd = ENCODINGS.index(encoding) % 2
  return dict(d_model=D_MODEL, num_heads=2, num_layers=1, mlp_dim=32, position_encoding=encoding, max_length=16,
              norm_type="rmsnorm" if odd else "layernorm", mlp_type="swiglu" if odd else "mlp",
              tie_output=not odd, num_kv_heads=1 if odd else 2)


@functools.lru_cache(maxsize=None)
def _model(encoding: str, **overrides) -> lm.LanguageModel:
  return lm.LanguageModel(VOCAB, **{**_options(encoding), **overrides}, rngs=nnx.Rngs(0))


@nnx.jit
def _forward(model, tokens, positions, segment_ids):
  return model(tokens, positions=positions, segment_ids=segment_ids)


@nnx.jit
def _plain_forward(model, tokens):
  return model(tokens)


@nnx.jit
def _prefill(model, tokens, valid, cache):
  return model.prefill(tokens, cache, valid=valid)


@nnx.jit
def _step(model, tokens, cache):
  return model.decode_step(tokens, cache)


@nnx.jit
def _loop_step(model, tokens, cache):  # the search loops' step: layers sliced and output table transposed once
  return model.loop_step()(tokens, cache)


def _tokens(shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(3, VOCAB, shape), jnp.int32)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_output_at_i_has_zero_gradient_from_inputs_after_i(encoding):
  model = _model(encoding)
  prefix = jax.random.normal(jax.random.key(1), (1, LENGTH, D_MODEL))
  weights = jax.random.normal(jax.random.key(2), (VOCAB,))

  @nnx.jit
  def jacobian(model, prefix):
    # outputs [t] of the prefix embeddings -> d output_i / d input_j: [t, t, d_model]
    outputs = lambda p: model(jnp.zeros((1, 0), jnp.int32), prefix=p)[0] @ weights
    return jax.jacrev(outputs)(prefix)[:, 0]

  norms = np.asarray(jnp.linalg.norm(jacobian(model, prefix), axis=-1))  # -> [t (output), t (input)]
  later = np.triu(np.ones((LENGTH, LENGTH), bool), k=1)
  assert np.all(norms[later] == 0.0)
  assert np.all(norms[~later] > 0.0)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_packed_row_equals_its_documents_run_alone(encoding):
  model = _model(encoding)
  first, second = _tokens((3,), seed=1), _tokens((4,), seed=2)
  packed = jnp.concatenate([first, second, jnp.zeros((1,), jnp.int32)])[None]
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]], jnp.int32)
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]], jnp.int32)
  together = _forward(model, packed, positions, segment_ids)[0]
  # Alone: each document from position 0, right-padded (later tokens cannot reach earlier outputs).
  alone = _plain_forward(model, jnp.stack([jnp.pad(first, (0, LENGTH - 3)), jnp.pad(second, (0, LENGTH - 4))]))
  np.testing.assert_allclose(together[:3], alone[0, :3], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(together[3:7], alone[1, :4], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_prefill_then_cached_steps_equal_the_full_forward(encoding):
  model = _model(encoding)
  tokens = _tokens((2, LENGTH))
  full = _plain_forward(model, tokens)
  logits, cache = _prefill(model, tokens[:, :5], jnp.ones((2, 5), bool), model.init_cache(2, 12))
  steps = [logits]
  for i in range(5, LENGTH):
    logits, cache = _loop_step(model, tokens[:, i:i + 1], cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoding", ("learned", "rope", "alibi", "t5_bias"))  # each reads per-row positions
def test_left_padded_ragged_prompts_equal_each_prompt_alone(encoding):
  model = _model(encoding)
  lengths, new = (2, 5, 3), 3
  sequences = [np.asarray(_tokens((n + new,), seed=10 + n)) for n in lengths]
  tokens, valid = lm.left_pad([s[:n] for s, n in zip(sequences, lengths)])
  logits, cache = _prefill(model, jnp.asarray(tokens), jnp.asarray(valid), model.init_cache(3, 12))
  batched = [logits[:, -1:]]  # each row's last prompt token
  for i in range(new - 1):
    logits, cache = _step(model, jnp.asarray(np.stack([s[n + i] for s, n in zip(sequences, lengths)])[:, None]),
                          cache)
    batched.append(logits)
  batched = np.asarray(jnp.concatenate(batched, axis=1))  # -> [3, new, vocab]
  alone = np.asarray(_plain_forward(model, jnp.asarray(lm.left_pad(  # right-padded rows, each from position 0
      [np.pad(s, (0, LENGTH - len(s))) for s in sequences])[0])))
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(batched[row], alone[row, n - 1:n - 1 + new], atol=1e-5, rtol=1e-5)


def test_scanned_and_rematerialised_stacks_equal_the_unrolled_one():
  tokens = _tokens((2, LENGTH))
  unrolled = _plain_forward(_model("alibi", num_layers=2), tokens)
  for options in (dict(scan_layers=True), dict(scan_layers=True, remat="full"), dict(remat="dots")):
    np.testing.assert_allclose(_plain_forward(_model("alibi", num_layers=2, **options), tokens), unrolled,
                               atol=1e-6, rtol=1e-6)


def test_mrope_with_text_positions_equals_rope():
  tokens = _tokens((2, LENGTH))
  same = dict(num_kv_heads=2, norm_type="layernorm", mlp_type="mlp", tie_output=True)
  mrope = _model("mrope", **same)
  rope = _plain_forward(_model("rope", **same), tokens)
  np.testing.assert_allclose(_plain_forward(mrope, tokens), rope, atol=1e-6, rtol=1e-6)
  positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (3, 2, LENGTH))  # explicit [3, b, t]
  np.testing.assert_allclose(_forward(mrope, tokens, positions, None), rope, atol=1e-6, rtol=1e-6)


def test_nothing_inserted_leaves_the_logits_bit_for_bit_unchanged():
  model = _model("rope", num_layers=2)
  tokens = _tokens((2, LENGTH))
  memory = jax.random.normal(jax.random.key(3), (2, 4, 12))
  gated = blocks.GatedCrossAttentionBlock(D_MODEL, 12, 2, 32, rngs=nnx.Rngs(5))  # its gates start at zero

  @nnx.jit
  def with_inserted(model, gated, tokens, memory):
    inserted = lambda x: gated(x, memory)
    return model(tokens, insert={0: inserted, 2: inserted})

  np.testing.assert_array_equal(np.asarray(with_inserted(model, gated, tokens, memory)),
                                np.asarray(_plain_forward(model, tokens)))


def test_prefix_of_token_embeddings_equals_the_tokens():
  model = _model("learned")
  tokens = _tokens((2, LENGTH))

  @nnx.jit
  def split(model, tokens):
    prefix = model.embed(tokens[:, :3]) * jnp.sqrt(float(D_MODEL))
    return model(tokens[:, 3:], prefix=prefix)

  np.testing.assert_allclose(split(model, tokens), _plain_forward(model, tokens), atol=1e-6, rtol=1e-6)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="position_encoding"):
    lm.LanguageModel(VOCAB, **{**_options("rope"), "position_encoding": "rope_2d"}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm_type"):
    lm.LanguageModel(VOCAB, **{**_options("rope"), "norm_type": "batchnorm"}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\), got dropout_rate=1.5"):
    lm.LanguageModel(VOCAB, **_options("rope"), dropout_rate=1.5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="d_model=18, num_heads=4"):
    lm.LanguageModel(VOCAB, **{**_options("rope"), "d_model": 18, "num_heads": 4}, rngs=nnx.Rngs(0))
  model = _model("learned")
  with pytest.raises(ValueError, match="capacity=17"):
    model.init_cache(1, 17)
  with pytest.raises(ValueError, match="insert keys"):
    model(_tokens((1, 4)), insert={3: lambda x: x})


def test_init_cache_takes_numpy_ints_as_the_shapes_they_are():
  # A batch size read from an array's shape (np.int64) was refused as "must be a positive int", where the attention
  # layers' init_cache and the searches take NumPy ints.
  model = _model("rope")
  numpy_sized = model.init_cache(np.int64(2), np.int32(12))
  assert jax.tree.map(jnp.shape, numpy_sized) == jax.tree.map(jnp.shape, model.init_cache(2, 12))
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    model.init_cache(np.bool_(True), 12)


# --- randomized positions ---------------------------------------------------------------------------

RANDOMIZED = 64  # max_position of the randomized models below (max_length 16)


@functools.lru_cache(maxsize=None)
def _randomized_model(encoding: str, at_eval: bool = False) -> lm.LanguageModel:
  randomized = lm.RandomizedPositions(max_position=RANDOMIZED, at_eval=at_eval)
  return lm.LanguageModel(VOCAB, **_options(encoding), randomized_positions=randomized, rngs=nnx.Rngs(0))


def _without_randomized_positions(model):
  """The same parameters with randomized positions off: positions are used as given."""
  plain = nnx.clone(model)
  plain.positions.randomized = lm.RandomizedPositions()
  return plain


@nnx.jit
def _trained_forward(model, tokens, positions, segment_ids, rng):
  return model(tokens, positions=positions, segment_ids=segment_ids, position_rng=rng)


def test_randomized_document_positions_are_sorted_distinct_draws_within_each_document():
  positions = np.array([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 0, 0]] * 64, np.int32)  # documents of 4, 3, 2, 1 + padding
  drawn = np.asarray(jax.jit(lm.randomized_document_positions, static_argnums=2)(
      jax.random.key(0), jnp.asarray(positions), 50))
  assert drawn.dtype == np.int32 and drawn.min() >= 0 and drawn.max() < 50
  for start, end in ((0, 4), (4, 7), (7, 9)):
    assert np.all(np.diff(drawn[:, start:end], axis=1) > 0)  # sorted, distinct
  assert len(np.unique(drawn[:, 4])) > 10  # the second document's first position is a draw, not 0
  assert not np.array_equal(drawn[0], drawn[1])  # every row draws anew


def test_eval_positions_of_a_randomized_model_are_0_to_n_minus_1_by_default():
  model = _randomized_model("rope")
  tokens = _tokens((2, LENGTH))
  plain = _plain_forward(_without_randomized_positions(model), tokens)
  np.testing.assert_allclose(_plain_forward(model, tokens), plain, atol=1e-6, rtol=1e-6)
  trained = _trained_forward(model, tokens, None, None, jax.random.key(1))
  assert not np.allclose(trained, plain, atol=1e-3)  # a training pass draws other positions


def test_a_packed_training_pass_draws_positions_per_document():
  """The packed row equals its documents run alone at the per-document positions drawn from the same key."""
  model = _randomized_model("learned")
  first, second = _tokens((3,), seed=1), _tokens((4,), seed=2)
  packed = jnp.concatenate([first, second, jnp.zeros((1,), jnp.int32)])[None]
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]], jnp.int32)
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]], jnp.int32)
  rng = jax.random.key(3)
  together = _trained_forward(model, packed, positions, segment_ids, rng)[0]
  drawn = lm.randomized_document_positions(rng, positions, RANDOMIZED)[0]
  plain = _without_randomized_positions(model)
  for start, end in ((0, 3), (3, 7)):
    alone = _forward(plain, packed[:, start:end], drawn[None, start:end], None)[0]
    np.testing.assert_allclose(together[start:end], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("at_eval", (False, True))
def test_prefill_then_cached_steps_equal_the_full_forward_at_the_eval_positions(at_eval):
  model = _randomized_model("alibi", at_eval)
  tokens = _tokens((2, LENGTH))
  cache = model.init_cache(2, 12)
  logits, cache = _prefill(model, tokens[:, :5], jnp.ones((2, 5), bool), cache)
  steps = [logits]
  for i in range(5, LENGTH):
    logits, cache = _step(model, tokens[:, i:i + 1], cache)
    steps.append(logits)
  if at_eval:  # the cache's one sorted draw for its capacity; a step reads its prefix
    assert cache.position_table is not None and not np.array_equal(cache.position_table[:, :LENGTH],
                                                                    np.broadcast_to(np.arange(LENGTH), (2, LENGTH)))
    positions = cache.position_table[:, :LENGTH]
  else:
    assert cache.position_table is None
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (2, LENGTH))
  full = _forward(_without_randomized_positions(model), tokens, positions, None)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_bad_randomized_positions_are_named():
  with pytest.raises(ValueError, match=r"randomized_positions\.max_position must be >= max_length=16"):
    lm.LanguageModel(VOCAB, **_options("rope"), randomized_positions=lm.RandomizedPositions(max_position=8),
                     rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="randomized positions apply to"):
    lm.LanguageModel(VOCAB, **_options("mrope"), randomized_positions=lm.RandomizedPositions(max_position=64),
                     rngs=nnx.Rngs(0))


def test_a_greedy_search_reads_the_mlp_kernels_stored_out_by_in():
  """loop_step hands the search its layers with every kernel stored [out, in] (dense.loop_kernels): the
  compiled loop contracts the MLP's kernels on their minor axis; transpose_kernels=False reads them as
  trained, [in, out], contracted on their major axis. Both decode the same tokens."""
  from xattn_jax import decoding
  model = _model("rope", mlp_dim=24)  # the plain MLP: wi [16, 24], wo [24, 16]
  graphdef, state = nnx.split(model)

  def search(state, first, transpose):
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(2, 8)
    return decoding.greedy_search(model.loop_step(transpose_kernels=transpose), cache, batch_size=2, max_length=6,
                                  bos_id=1, eos_id=2, first_tokens=first).tokens

  first = jnp.array([3, 4], jnp.int32)
  runs = {transpose: jax.jit(search, static_argnums=2).lower(state, first, transpose).compile()
          for transpose in (True, False)}
  assert np.array_equal(runs[True](state, first), runs[False](state, first))
  if jax.default_backend() != "cpu":
    pytest.skip("a statement about XLA:CPU's layouts")
  bodies = {transpose: helpers.loop_body_dots(compiled.as_text()) for transpose, compiled in runs.items()}
  for transpose, contracted in ((True, "rhs_contracting_dims={1}"), (False, "rhs_contracting_dims={0}")):
    mlp = [b for b in bodies[transpose] if "f32[24,16]" in b or "f32[16,24]" in b]  # wi, wo: as trained or stored
    assert len(mlp) >= 2 and all(contracted in b for b in mlp), (transpose, mlp)


@pytest.mark.parametrize("method", ["sample", "beam"])  # sample: greedy's loop, with more varied tokens
def test_searches_over_a_long_cache_decode_its_first_half_on_that_half(method):
  """A cache of 64 slots decodes while its fill stays below 32 on those 32 slots alone (LMCache.head),
  then on the whole (with_head): the same tokens and scores as decoding on the whole cache throughout.
  One row is left-padded and the rotary positions come from a drawn table (LMCache.position_table); a
  prompt that already fills the first half starts on the whole cache (cutting it would lose filled slots)."""
  from xattn_jax import decoding
  model = lm.LanguageModel(VOCAB, **_options("rope"), rngs=nnx.Rngs(0),
                           randomized_positions=lm.RandomizedPositions(max_position=96, at_eval=True))
  nnx.update(model, jax.tree.map(lambda x: x * 3, nnx.state(model, nnx.Param)))  # sharper: varied beams
  def search(prompt, valid, cache_halves):
    capacities = []
    options = decoding.DecodingOptions(method=method, beam_size=3, cache_halves=cache_halves)

    def run(model, prompt, valid):
      cache = model.init_cache(prompt.shape[0], 64)
      _, cache = model.prefill(prompt[:, :-1], cache, valid=valid[:, :-1])
      step = model.loop_step()
      return decoding.search(lambda tokens, cache: (capacities.append(cache.capacity), step(tokens, cache))[1],
                             cache, options, batch_size=prompt.shape[0], max_length=64 - prompt.shape[1] + 1,
                             bos_id=1, eos_id=VOCAB, first_tokens=prompt[:, -1],  # eos never: every step runs
                             rng=jax.random.key(0), suppress_ids=(0,))
    out = nnx.jit(run)(model, prompt, valid)
    return np.asarray(out.tokens), np.asarray(out.scores), sorted(set(capacities))

  # The prompt of 40 fills the first half already: the loop on the head is compiled, but never runs.
  for width in (8, 40):
    prompt = _tokens((2, width), seed=width)
    valid = jnp.ones((2, width), bool).at[1, :3].set(False)  # row 1 left-padded
    halves, whole = search(prompt, valid, True), search(prompt, valid, False)
    assert halves[2] == [32, 64] and whole[2] == [64], (width, halves[2], whole[2])
    np.testing.assert_array_equal(halves[0], whole[0])
    np.testing.assert_allclose(halves[1], whole[1], rtol=1e-5)
    assert len(np.unique(halves[0])) > 5  # a varied decode, past the boundary at slot 32


@pytest.mark.parametrize("encoding", ["rope", "learned"])  # tied and untied output
def test_bfloat16_compute_returns_float32_logits_in_every_pass(encoding):
  """The docstring's "Logits are float32": the training pass, the pre-fill and the search loops' step."""
  model = _model(encoding, dtype=jnp.bfloat16)
  tokens = _tokens((2, 6))
  logits, cache = _prefill(model, tokens[:, :5], jnp.ones((2, 5), bool), model.init_cache(2, 12))
  step_logits, _ = _loop_step(model, tokens[:, 5:], cache)
  assert [x.dtype for x in (_plain_forward(model, tokens), logits, step_logits)] == [jnp.float32] * 3


def test_a_cache_of_another_depth_is_refused():
  deeper = _model("rope", num_layers=2)
  with pytest.raises(ValueError, match="cache has 1 layers, the model num_layers=2"):
    deeper.prefill(_tokens((1, 4)), _model("rope").init_cache(1, 8))


def test_a_prompt_longer_than_the_cache_and_a_bad_step_are_named():
  model = _model("rope")
  with pytest.raises(ValueError, match=r"prefill: 10 tokens .* capacity=8"):
    model.prefill(_tokens((1, 10)), model.init_cache(1, 8))
  with pytest.raises(ValueError, match=r"LanguageModel\.decode_step: tokens must be int"):
    model.decode_step(jnp.ones((1, 1)), model.init_cache(1, 8))


@pytest.mark.parametrize("bad_id", [-1, VOCAB])
def test_an_id_outside_the_vocabulary_makes_its_row_nan(bad_id):
  tokens = _tokens((2, LENGTH)).at[1, 1].set(bad_id)  # the shape other tests compile the pass for
  logits = _plain_forward(_model("rope"), tokens)
  assert not np.isnan(logits[0]).any() and np.isnan(logits[1, 1]).all()
