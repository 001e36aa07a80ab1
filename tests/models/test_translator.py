"""The encoder-decoder translator: shapes, causality, caches, packing, position switch."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from xattn_jax import decoding
from xattn_jax.models import translator as translator_lib
from xattn_jax.models.translator import StackSize, Translator
from xattn_jax.ops import positions as positions_ops

VOCAB = 40
# Widths differ on purpose; one layer each keeps compile times short (stacking is tested with two).
ENCODER, DECODER = StackSize(32, 4, 1, 64), StackSize(48, 4, 1, 64)
TWO_LAYERS = StackSize(32, 4, 2, 64)


def _model(position_encoding="sinusoidal", *, encoder=ENCODER, decoder=DECODER, **options):
  options.setdefault("share_embeddings", encoder.d_model == decoder.d_model)
  return Translator(VOCAB, encoder=encoder, decoder=decoder, position_encoding=position_encoding, max_length=16,
                    rngs=nnx.Rngs(params=0, dropout=1), **options)


def _tokens(seed, batch, length, pad_from=None):
  ids = np.random.default_rng(seed).integers(3, VOCAB, (batch, length)).astype(np.int32)
  if pad_from is not None:
    ids[-1, pad_from:] = 0  # the last row is padded
  return jnp.asarray(ids)


def _full_and_cached(state, graphdef, inputs, decoder_inputs, prompt_length):
  """Teacher-forced logits, and the same from a prompt pre-fill (decode_step) then one token per step
  (loop_step, the decoding loops' step with the per-layer weights sliced once, in a loop as theirs: the step is
  compiled once, however many steps)."""
  model = nnx.merge(graphdef, state)
  full = model(inputs, decoder_inputs)
  cache = model.init_cache(model.encode(inputs), inputs != 0, decoder_inputs.shape[1])
  first, cache = model.decode_step(decoder_inputs[:, :prompt_length], cache)
  step = model.loop_step()

  def scan_step(cache, tokens):  # tokens [b]
    logits, cache = step(tokens[:, None], cache)
    return cache, logits[:, 0]

  _, steps = jax.lax.scan(scan_step, cache, decoder_inputs[:, prompt_length:].T)  # -> [t - prompt, b, vocab]
  return full, jnp.concatenate([first, steps.transpose(1, 0, 2)], axis=1)


@nnx.jit
def _forward(model, inputs, decoder_inputs, **packing):
  return model(inputs, decoder_inputs, **packing)


def _compare_cached(model):
  graphdef, state = nnx.split(model)
  full, cached = jax.jit(_full_and_cached, static_argnums=(1, 4))(
      state, graphdef, _tokens(0, 2, 7, pad_from=4), _tokens(1, 2, 4), 2)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=2e-5, rtol=2e-5)


def test_shapes_of_memory_and_logits_with_different_widths():
  model = _model()
  inputs, decoder_inputs = _tokens(0, 3, 7), _tokens(1, 3, 5)
  chex.assert_shape(nnx.jit(lambda m, x: m.encode(x))(model, inputs), (3, 7, ENCODER.d_model))
  logits = _forward(model, inputs, decoder_inputs)
  chex.assert_shape(logits, (3, 5, VOCAB))
  assert logits.dtype == jnp.float32


@pytest.mark.parametrize("position_encoding", translator_lib.position_encodings())
def test_cached_decode_steps_equal_full_forward(position_encoding):
  _compare_cached(_model(position_encoding))


def test_cached_decode_steps_equal_scanned_full_forward():
  _compare_cached(_model("rope", encoder=TWO_LAYERS, decoder=TWO_LAYERS, scan_layers=True, tie_output=False))


def test_scanned_training_pass_with_dropout_equals_unrolled_under_the_same_rngs():
  inputs, decoder_inputs = _tokens(0, 2, 7, pad_from=4), _tokens(1, 2, 5)
  train = nnx.jit(lambda m: m(inputs, decoder_inputs, deterministic=False))
  options = dict(encoder=TWO_LAYERS, decoder=TWO_LAYERS, dropout_rate=0.3, attention_dropout_rate=0.3)
  scanned = train(_model(scan_layers=True, **options))
  np.testing.assert_allclose(scanned, train(_model(scan_layers=False, **options)), atol=2e-5, rtol=2e-5)
  assert not np.allclose(scanned, _forward(_model(scan_layers=True, **options), inputs, decoder_inputs))


def test_decoder_logits_do_not_depend_on_later_target_embeddings():
  model = _model("rope", encoder=TWO_LAYERS, decoder=TWO_LAYERS)
  inputs = _tokens(0, 1, 6)
  embedded = jax.random.normal(jax.random.key(0), (1, 5, TWO_LAYERS.d_model))

  @nnx.jit
  def jacobian(model, inputs, embedded):
    memory, memory_mask = model.encode(inputs), model.memory_mask(inputs)
    logit_sums = lambda x: model.decode_embeddings(x, memory, memory_mask)[0].sum(-1)  # -> [t]
    return jax.jacrev(logit_sums)(embedded)[:, 0]  # -> [t (logits), t (embeddings), d_model]

  norms = np.asarray(jnp.abs(jacobian(model, inputs, embedded)).sum(-1))  # -> [t, t]
  later = np.triu(np.ones_like(norms, dtype=bool), k=1)
  assert (norms[later] == 0).all(), f"logits depend on later positions: {norms}"
  assert (norms[~later] > 0).all()


def test_padded_source_tokens_do_not_change_logits():
  model = _model()
  inputs = _tokens(0, 2, 7, pad_from=4)
  changed = inputs.at[-1, 1].set(jnp.where(inputs[-1, 1] == 5, 6, 5))  # a different real token
  decoder_inputs = _tokens(1, 2, 5)
  short = _forward(model, inputs[:, :4], decoder_inputs)
  padded = _forward(model, inputs, decoder_inputs)
  np.testing.assert_allclose(np.asarray(padded[-1]), np.asarray(short[-1]), atol=1e-5)
  assert not np.allclose(np.asarray(_forward(model, changed, decoder_inputs)[-1]), np.asarray(padded[-1]), atol=1e-5)


def test_packed_rows_equal_examples_run_separately():
  model = _model("rope", encoder=TWO_LAYERS, decoder=TWO_LAYERS)
  src_a, src_b, tgt_a, tgt_b = _tokens(0, 1, 3), _tokens(1, 1, 4), _tokens(2, 1, 2), _tokens(3, 1, 3)
  inputs = jnp.concatenate([src_a, src_b, jnp.zeros((1, 1), jnp.int32)], axis=1)  # -> [1, 8]
  decoder_inputs = jnp.concatenate([tgt_a, tgt_b, jnp.zeros((1, 1), jnp.int32)], axis=1)  # -> [1, 6]
  packed = _forward(model, inputs, decoder_inputs,
                 inputs_segmentation=jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
                 inputs_positions=jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]]),
                 targets_segmentation=jnp.array([[1, 1, 2, 2, 2, 0]]),
                 targets_positions=jnp.array([[0, 1, 0, 1, 2, 0]]))
  # The same two examples as two padded rows of an ordinary batch.
  separate = _forward(model, jnp.concatenate([jnp.pad(src_a, ((0, 0), (0, 1))), src_b]),
                      jnp.concatenate([jnp.pad(tgt_a, ((0, 0), (0, 1))), tgt_b]))  # -> [2, 3, vocab]
  np.testing.assert_allclose(np.asarray(packed[0, :2]), np.asarray(separate[0, :2]), atol=2e-5)
  np.testing.assert_allclose(np.asarray(packed[0, 2:5]), np.asarray(separate[1]), atol=2e-5)


def test_greedy_generation_equals_argmax_of_full_model_on_growing_prefix():
  model = _model("learned")
  inputs = _tokens(0, 2, 6, pad_from=3)
  steps = 5
  generated = nnx.jit(decoding.generate, static_argnames=("max_length", "bos_id", "eos_id"))(
      model, inputs, max_length=steps, bos_id=1, eos_id=2)
  # The prefix lives in a fixed-length buffer (one compiled shape); the causal decoder ignores
  # the unfilled tail, as test_decoder_logits_do_not_depend_on_later_target_embeddings checks.
  prefix = jnp.zeros((2, steps), jnp.int32).at[:, 0].set(1)
  for t in range(steps):
    choice = jnp.argmax(_forward(model, inputs, prefix)[:, t], axis=-1).astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(generated[:, t]), np.asarray(choice), err_msg=f"step {t}")
    if t + 1 < steps:
      prefix = prefix.at[:, t + 1].set(choice)


def test_a_source_id_past_the_vocabulary_reaches_the_logits_as_nan_and_the_search_marks_its_row():
  """The cross-attention's guard for a query that sees no key read the NaN memory of such an id as "no key" and
  gave zeros: the row decoded a plausible translation of nothing, where the class docstring promises NaN. (The
  shapes and model of test_greedy_generation_equals_argmax_of_full_model_on_growing_prefix: its compiles.)"""
  model = _model("learned")
  inputs = _tokens(0, 2, 6, pad_from=3).at[0, 1].set(VOCAB + 5)
  assert bool(jnp.all(jnp.isnan(_forward(model, inputs, _tokens(1, 2, 5))[0])))
  tokens = nnx.jit(decoding.generate, static_argnames=("max_length", "bos_id", "eos_id"))(
      model, inputs, max_length=5, bos_id=1, eos_id=2)
  assert bool(jnp.all(tokens[0] == decoding.INVALID_TOKEN)) and bool(jnp.all(tokens[1] >= 0))


def test_beam_search_scores_equal_full_model_rescoring_of_its_beams():
  """Beam search reorders the real TranslatorCache rows; a wrong reorder breaks these scores."""
  model = _model("rope")
  inputs = _tokens(0, 2, 6, pad_from=3)
  steps, beams = 4, 3

  @nnx.jit
  def search(model, inputs):
    cache = model.init_cache(model.encode(inputs), inputs != 0, steps)
    # eos_id = VOCAB is never produced, so every beam runs all steps and scores sum log-probs.
    return decoding.beam_search(model.decode_step, cache, batch_size=2, beam_size=beams, max_length=steps,
                                bos_id=1, eos_id=VOCAB, alpha=0.0)

  result = search(model, inputs)
  tokens = result.tokens.reshape(2 * beams, steps)
  decoder_inputs = jnp.concatenate([jnp.ones((2 * beams, 1), jnp.int32), tokens[:, :-1]], axis=1)
  log_probs = jax.nn.log_softmax(_forward(model, jnp.repeat(inputs, beams, axis=0), decoder_inputs))
  expected = jnp.take_along_axis(log_probs, tokens[:, :, None], axis=-1).sum(axis=(1, 2))
  np.testing.assert_allclose(np.asarray(result.scores).reshape(-1), np.asarray(expected), rtol=1e-4)


@pytest.mark.parametrize("position_encoding", ["rope", "t5_bias"])
def test_beam_search_over_the_index_reordered_cache_equals_gathering_its_rows(position_encoding):
  """TranslatorCache expands / reorders itself (memory once per source, self-attention reordered by
  index); hidden inside a dict, the same cache takes decoding's generic path (every row repeated,
  then gathered by parent beam each step). Both must find the same beams."""
  model = _model(position_encoding)
  inputs = _tokens(2, 2, 6, pad_from=3)
  steps, beams = 4, 3

  @nnx.jit
  def search(model, inputs):
    cache = model.init_cache(model.encode(inputs), inputs != 0, steps)
    step = model.loop_step()
    options = dict(batch_size=2, beam_size=beams, max_length=steps, bos_id=1, eos_id=2, alpha=0.6)
    own = decoding.beam_search(step, cache, **options)
    hidden_step = lambda tokens, hidden: (lambda logits, c: (logits, {"cache": c}))(*step(tokens, hidden["cache"]))
    return own, decoding.beam_search(hidden_step, {"cache": cache}, **options)

  own, generic = search(model, inputs)
  np.testing.assert_array_equal(np.asarray(own.tokens), np.asarray(generic.tokens))
  np.testing.assert_allclose(np.asarray(own.scores), np.asarray(generic.scores), rtol=1e-5)


@pytest.mark.parametrize("position_encoding", ["rope", "t5_bias"])
def test_searches_over_a_long_cache_decode_its_first_half_on_that_half(position_encoding):
  """Self-attention caches of 64 positions decode their first 32 on those alone (TranslatorCache.head), then on
  the whole (with_head), greedy and beam search (its caches in the beam layout, the ancestry rewritten in
  the head): the same tokens and scores as decoding on the whole caches throughout."""
  model = _model(position_encoding)
  nnx.update(model, jax.tree.map(lambda x: x * 3, nnx.state(model, nnx.Param)))  # sharper: varied tokens
  inputs = _tokens(5, 2, 6, pad_from=3)

  def search(cache_halves):
    capacities = []

    @nnx.jit
    def run(model, inputs):
      cache = model.init_cache(model.encode(inputs), inputs != 0, 64)
      step = model.loop_step()
      traced = lambda tokens, cache: (capacities.append(cache.capacity), step(tokens, cache))[1]  # noqa: E731
      options = dict(batch_size=2, max_length=48, bos_id=1, eos_id=VOCAB,  # eos never: every step runs
                     cache_halves=cache_halves)
      return (decoding.greedy_search(traced, cache, **options),
              decoding.beam_search(traced, cache, beam_size=3, alpha=0.6, **options))
    (greedy, beam) = run(model, inputs)
    return [np.asarray(x) for x in (greedy.tokens, greedy.scores, beam.tokens, beam.scores)], sorted(set(capacities))

  (halves, capacities), (whole, whole_capacities) = search(True), search(False)
  assert capacities == [32, 64] and whole_capacities == [64]
  for got, expected in zip(halves, whole):
    np.testing.assert_allclose(got, expected, rtol=1e-5)
  assert len(np.unique(halves[0][:, 32:])) > 3 and len(np.unique(halves[2][:, :, 32:])) > 3  # varied past 32


def test_rope_switch_rotates_self_attention_and_adds_no_parameters():
  rope, sinusoidal = _model("rope"), _model("sinusoidal")
  assert rope.decoder_blocks.self_attention.rotary.kind == "rope"
  assert rope.encoder_blocks.attention.rotary.kind == "rope"
  assert sinusoidal.decoder_blocks.self_attention.rotary is None
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.state(m, nnx.Param))
  assert shapes(rope) == shapes(sinusoidal)
  inputs, decoder_inputs = _tokens(0, 1, 5), _tokens(1, 1, 4)
  assert not np.allclose(np.asarray(_forward(rope, inputs, decoder_inputs)),
                         np.asarray(_forward(sinusoidal, inputs, decoder_inputs)))


def test_cross_attention_weights_are_distributions_over_real_source_tokens():
  model = _model()
  inputs = _tokens(0, 2, 7, pad_from=4)
  weights = nnx.jit(lambda m, x, y: m.cross_attention_weights(x, y))(model, inputs, _tokens(1, 2, 5))
  chex.assert_shape(weights, (DECODER.num_layers, 2, DECODER.num_heads, 5, 7))
  np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
  assert (np.asarray(weights[:, -1, :, :, 4:]) == 0).all()


def test_bfloat16_compute_stays_close_to_float32():
  inputs, decoder_inputs = _tokens(0, 2, 6), _tokens(1, 2, 5)
  full = _forward(_model(), inputs, decoder_inputs)
  half = _forward(_model(dtype=jnp.bfloat16), inputs, decoder_inputs)
  assert half.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(half), np.asarray(full), atol=0.15)


@pytest.mark.parametrize("options, argument", [
    (dict(position_encoding="rope_2d"), "position_encoding"),
    (dict(share_embeddings=True), "share_embeddings"),
    (dict(remat="everything"), "remat"),
    (dict(dropout_rate=1.5), r"dropout_rate must be in \[0, 1\), got dropout_rate=1.5"),
])
def test_invalid_options_are_rejected(options, argument):
  with pytest.raises(ValueError, match=argument):
    _model(**options)


@pytest.mark.parametrize("sizes, argument", [((32, 0, 1, 64), "num_heads=0"), ((32, 4, 1, 0), "mlp_dim=0"),
                                             ((32.0, 4, 1, 64), "d_model=32.0")])
def test_bad_stack_sizes_are_named(sizes, argument):
  with pytest.raises(ValueError, match=argument):
    StackSize(*sizes)


def test_bad_max_length_and_sides_are_named():
  with pytest.raises(ValueError, match="max_length=0"):
    Translator(VOCAB, encoder=ENCODER, decoder=DECODER, max_length=0, share_embeddings=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="encoder must be a StackSize"):
    Translator(VOCAB, encoder=(32, 4, 1, 64), decoder=DECODER, share_embeddings=False, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("positions", [jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 5))])
def test_bad_explicit_positions_are_named(positions):
  with pytest.raises(ValueError, match=r"inputs_positions must be int \[1, 5\]"):
    _model().encode(_tokens(0, 1, 5), inputs_positions=positions)


def test_float_tokens_are_rejected():
  with pytest.raises(ValueError, match="inputs"):
    _model().encode(jnp.zeros((1, 3)))
  with pytest.raises(ValueError, match="inputs must be int .*list"):
    _model().encode([[1, 2, 3]])


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_empty_tokens_are_refused_naming_the_argument(shape):
  # They failed inside the attention op: "query [batch, length, heads, head_dim] must have no empty dimension".
  with pytest.raises(ValueError, match=rf"^Translator: inputs must be int \[batch, length\] with batch and length "
                                       rf">= 1, got int32\[{shape[0]}, {shape[1]}\]"):
    decoding.generate(_model(), jnp.zeros(shape, jnp.int32), max_length=2, bos_id=1, eos_id=2)


def test_decoding_past_a_learned_position_table_is_refused():
  # The table has 16 rows; 20 decode steps would read rows 16-19 (NaN logits, which a search would
  # turn into tokens).
  model = _model(position_encoding="learned")
  inputs = _tokens(0, 1, 5)
  with pytest.raises(ValueError, match=r"max_length=20 .* 16 rows"):
    decoding.generate(model, inputs, max_length=20, bos_id=1, eos_id=2)
  assert decoding.generate(model, inputs, max_length=16, bos_id=1, eos_id=2).shape == (1, 16)


def test_searches_refuse_to_decode_past_the_cache_capacity():
  """init_cache(..., 2) and max_length=6: greedy used to return tokens vocab-1 from NaN logits."""
  model = _model()
  inputs = _tokens(0, 1, 5)
  cache = model.init_cache(model.encode(inputs), inputs != 0, 2)
  assert cache.decode_room() == 2
  with pytest.raises(ValueError, match="max_length=6 needs 6 more tokens of cache, but the cache has room for 2"):
    decoding.greedy_search(model.loop_step(), cache, batch_size=1, max_length=6, bos_id=1, eos_id=2)
  with pytest.raises(ValueError, match="room for 2"):
    decoding.beam_search(model.loop_step(), cache, batch_size=1, beam_size=2, max_length=6, bos_id=1, eos_id=2)
  _, cache = model.decode_step(jnp.ones((1, 1), jnp.int32), cache)
  assert cache.decode_room() == 1


# --- randomized positions ---------------------------------------------------------------------

RANDOMIZED = translator_lib.RandomizedPositions(max_position=32)
SMALL = StackSize(16, 2, 1, 32)


@pytest.mark.parametrize("position_encoding", ["learned", "sinusoidal", "rope"])
def test_training_on_randomized_positions_lowers_the_loss(position_encoding):
  model = _model(position_encoding, encoder=SMALL, decoder=SMALL, randomized_positions=RANDOMIZED)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  inputs = _tokens(0, 8, 6)
  decoder_inputs = jnp.concatenate([jnp.ones((8, 1), jnp.int32), inputs[:, :-1]], axis=1)  # copy the source

  @nnx.jit
  def step(model, optimizer, key):
    def loss(model):
      logits = model(inputs, decoder_inputs, position_rng=key)
      return optax.softmax_cross_entropy_with_integer_labels(logits, inputs).mean()
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  losses = [float(step(model, optimizer, jax.random.key(i))) for i in range(40)]
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_a_pass_with_a_position_rng_draws_positions_and_one_without_uses_0_to_n_minus_1():
  inputs, decoder_inputs = _tokens(0, 2, 6), _tokens(1, 2, 5)
  randomized, plain = _model("rope", randomized_positions=RANDOMIZED), _model("rope")
  run = nnx.jit(lambda m, key: m(inputs, decoder_inputs, position_rng=key))
  evaluated = _forward(randomized, inputs, decoder_inputs)
  np.testing.assert_allclose(np.asarray(evaluated), np.asarray(_forward(plain, inputs, decoder_inputs)), atol=1e-6)
  assert not np.allclose(np.asarray(run(randomized, jax.random.key(0))), np.asarray(evaluated), atol=1e-3)


def test_randomized_positions_at_eval_are_the_fixed_draw_of_eval_seed():
  inputs, decoder_inputs = _tokens(0, 2, 6), _tokens(1, 2, 5)
  model = _model("rope", randomized_positions=translator_lib.RandomizedPositions(32, at_eval=True, eval_seed=3))
  draw = lambda length: positions_ops.randomized_positions(jax.random.key(3), 2, length, 32)
  np.testing.assert_allclose(
      np.asarray(_forward(model, inputs, decoder_inputs)),
      np.asarray(_forward(model, inputs, decoder_inputs, inputs_positions=draw(6), targets_positions=draw(5))),
      atol=1e-6)


@pytest.mark.parametrize("position_encoding", ["rope", "alibi"])
def test_cached_decode_steps_on_randomized_eval_positions_equal_full_forward(position_encoding):
  """The cache draws its capacity's positions once; steps read them instead of 0..t-1."""
  _compare_cached(_model(position_encoding,
                         randomized_positions=translator_lib.RandomizedPositions(32, at_eval=True)))


def test_randomized_positions_that_cannot_cover_max_length_are_refused():
  with pytest.raises(ValueError, match=r"randomized_positions.max_position must be >= max_length=16"):
    _model("rope", randomized_positions=translator_lib.RandomizedPositions(8))


def test_a_cache_of_another_depth_batch_or_too_short_is_refused():
  inputs = _tokens(0, 1, 5)
  model = _model()
  cache = model.init_cache(model.encode(inputs), inputs != 0, 4)
  with pytest.raises(ValueError, match="cache has 1 layers, the decoder num_layers=2"):
    _model(decoder=TWO_LAYERS, encoder=TWO_LAYERS).decode_step(jnp.ones((1, 1), jnp.int32), cache)
  with pytest.raises(ValueError, match="6 tokens do not fit the cache's capacity=4"):
    model.decode_step(jnp.ones((1, 6), jnp.int32), cache)
  with pytest.raises(ValueError, match="tokens batch 2 differs from the cache's 1 rows"):
    model.decode_step(jnp.ones((2, 1), jnp.int32), cache)
