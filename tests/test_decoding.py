"""Greedy and beam search over explicit caches, checked on tiny hand-made models."""
import dataclasses
import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from xattn_jax import decoding

PAD, BOS, EOS = 0, 1, 2
VOCAB, DIM, BATCH, MAX_LEN = 7, 8, 3, 6


def _sum_model(params):
  """A tiny causal model whose state is a per-example source vector plus the running sum of
  token embeddings (a stand-in for an encoder memory and a self-attention cache).

  full(prefix [b, t]) -> logits [b, t, vocab] recomputes everything from the prefix;
  step(tokens [b, 1], cache) -> (logits [b, 1, vocab], cache) keeps the sum and the position in
  the cache (the position as a scalar, a leaf with no batch axis, as a real fill index).
  EOS grows likelier with position so that sequences end at different steps; PAD and BOS are
  never predicted.
  """
  embed, out, sources = params
  never = jnp.zeros(VOCAB).at[PAD].set(-1e9).at[BOS].set(-1e9)

  def logits_at(state, position):
    eos_bias = (1.5 * position - 3.0) * jax.nn.one_hot(EOS, VOCAB)
    return jnp.tanh(state) @ out + eos_bias + never

  def full(prefix, sources=sources):
    states = sources[:, None] + jnp.cumsum(embed[prefix], axis=1)  # -> [b, t, dim]
    return logits_at(states, jnp.arange(prefix.shape[1])[None, :, None] + 0.0)

  def step(tokens, cache):
    state, position = cache
    state = state + embed[tokens[:, 0]]
    return logits_at(state, position + 0.0)[:, None], (state, position + 1)

  return jax.jit(full), step  # one compile per prefix length, not one per op


def _random_params(seed):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (VOCAB, DIM)), 2.0 * jax.random.normal(k2, (DIM, VOCAB)),
          jax.random.normal(k3, (BATCH, DIM)))


def _first_cache(params):
  return params[2], jnp.int32(0)


@functools.partial(jax.jit, static_argnames=("beam_size", "alpha"))
def _greedy_and_beam(params, beam_size, alpha):
  _, step = _sum_model(params)
  greedy = decoding.greedy_search(step, _first_cache(params), batch_size=BATCH, max_length=MAX_LEN,
                                  bos_id=BOS, eos_id=EOS)
  beam = decoding.beam_search(step, _first_cache(params), batch_size=BATCH, beam_size=beam_size,
                              max_length=MAX_LEN, bos_id=BOS, eos_id=EOS, alpha=alpha)
  return greedy, beam


def _sequence_log_prob(full, tokens, **full_kwargs):
  """Log-probability of generated tokens [b, L] (up to and including EOS) by the full model."""
  prefix = np.concatenate([np.full((tokens.shape[0], 1), BOS), tokens[:, :-1]], axis=1)
  log_probs = np.asarray(jax.nn.log_softmax(full(jnp.asarray(prefix), **full_kwargs)))  # [b, L, vocab]
  picked = np.take_along_axis(log_probs, tokens[:, :, None], axis=-1)[:, :, 0]
  ended_before = np.cumsum(tokens == EOS, axis=1) - (tokens == EOS)
  return np.where(ended_before > 0, 0.0, picked).sum(axis=1)


def test_cached_greedy_equals_argmax_of_full_model_on_growing_prefix():
  params = _random_params(0)
  full, _ = _sum_model(params)
  greedy, _ = _greedy_and_beam(params, 1, 0.0)
  prefix = np.full((BATCH, 1), BOS)
  finished = np.zeros(BATCH, bool)
  for t in range(MAX_LEN):
    choice = np.asarray(jnp.argmax(full(jnp.asarray(prefix))[:, -1], axis=-1))
    choice = np.where(finished, PAD, choice)
    np.testing.assert_array_equal(np.asarray(greedy.tokens[:, t]), choice, err_msg=f"step {t}")
    finished |= choice == EOS
    prefix = np.concatenate([prefix, choice[:, None]], axis=1)
  assert finished.any() and not finished.all(), "the model should finish some sequences, not all"


def test_greedy_score_is_log_probability_of_its_tokens():
  params = _random_params(1)
  full, _ = _sum_model(params)
  greedy, _ = _greedy_and_beam(params, 1, 0.0)
  tokens = np.asarray(greedy.tokens)
  np.testing.assert_allclose(np.asarray(greedy.scores), _sequence_log_prob(full, tokens), rtol=1e-5)


def test_greedy_pads_after_eos():
  greedy, _ = _greedy_and_beam(_random_params(2), 1, 0.0)
  tokens = np.asarray(greedy.tokens)
  after_eos = np.cumsum(tokens == EOS, axis=1) - (tokens == EOS) > 0
  assert after_eos.any()
  assert (tokens[after_eos] == PAD).all()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_beam_size_one_equals_greedy(seed):
  greedy, beam = _greedy_and_beam(_random_params(seed), 1, 0.0)
  np.testing.assert_array_equal(np.asarray(beam.tokens[:, 0]), np.asarray(greedy.tokens))
  np.testing.assert_allclose(np.asarray(beam.scores[:, 0]), np.asarray(greedy.scores), rtol=1e-5)


@pytest.mark.parametrize("seed, alpha", [(0, 0.0), (1, 0.6)])
def test_beam_scores_match_full_model_rescoring(seed, alpha):
  """Each returned beam's score is its full-model log-probability over its length penalty,
  which holds only if the cache rows followed their parent beams."""
  params = _random_params(seed)
  full, _ = _sum_model(params)
  _, beam = _greedy_and_beam(params, 3, alpha)
  tokens = np.asarray(beam.tokens).reshape(BATCH * 3, MAX_LEN)
  ended = (tokens == EOS).any(axis=1)
  lengths = np.where(ended, np.argmax(tokens == EOS, axis=1) + 1, MAX_LEN)
  expected = _sequence_log_prob(full, tokens, sources=jnp.repeat(params[2], 3, axis=0)) / ((5.0 + lengths) / 6.0) ** alpha
  np.testing.assert_allclose(np.asarray(beam.scores).reshape(-1), expected, rtol=1e-4)
  finished_first = np.sort(~ended.reshape(BATCH, 3), axis=1) == ~ended.reshape(BATCH, 3)
  assert finished_first.all(), "finished hypotheses must come before unfinished ones"


def _markov_step(table):
  """Next-token logits depend only on the last token: table [vocab, vocab] of probabilities."""
  log_table = jnp.log(jnp.asarray(table) + 1e-9)

  def step(tokens, cache):
    return log_table[tokens[:, 0]][:, None], cache + 1

  return step


# Vocabulary: 0 pad, 1 BOS, 2 EOS, 3 "A", 4 "B". Greedy takes A (0.6) and then ends (0.36):
# 0.216 in all; B (0.4) then EOS (0.9) is 0.36, the best sequence, which beam search must find.
_TRAP = np.array([
    [1.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.6, 0.4],
    [1.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.36, 0.32, 0.32],
    [0.0, 0.0, 0.9, 0.05, 0.05],
])


def _best_sequence_by_enumeration(table, max_length):
  best, best_p = None, -1.0
  for length in range(1, max_length + 1):
    for body in itertools.product([3, 4], repeat=length - 1):
      seq = (BOS,) + body + (EOS,)
      p = np.prod([table[a, b] for a, b in zip(seq[:-1], seq[1:])])
      if p > best_p:
        best, best_p = seq[1:], p
  return best, best_p


def test_beam_search_finds_best_sequence_where_greedy_does_not():
  step = _markov_step(_TRAP)
  run = jax.jit(lambda: (
      decoding.greedy_search(step, jnp.zeros(1), batch_size=1, max_length=4, bos_id=BOS, eos_id=EOS),
      decoding.beam_search(step, jnp.zeros(1), batch_size=1, beam_size=2, max_length=4, bos_id=BOS,
                           eos_id=EOS, alpha=0.0)))
  greedy, beam = run()
  best, best_p = _best_sequence_by_enumeration(_TRAP, 4)
  assert best == (4, EOS)
  assert tuple(np.asarray(greedy.tokens[0, :2])) == (3, EOS)
  assert tuple(np.asarray(beam.tokens[0, 0, :2])) == best
  np.testing.assert_allclose(float(beam.scores[0, 0]), np.log(best_p), rtol=1e-5)


@pytest.mark.parametrize("beam_size", [2, 4])  # 4: each beam's best 2 * 4 candidates exceed the vocabulary (7)
def test_beam_search_ranking_each_beam_first_finds_the_same_beams(beam_size):
  """With a logits_sharding, beam search ranks each beam's tokens first, then those candidates (the form a
  split vocabulary ranks per device; tests/training/test_distributed.py splits it): on one device it must
  find the beams and scores of ranking [batch, beams * vocab] at once, exactly."""
  params = _random_params(3)
  _, step = _sum_model(params)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
  kwargs = dict(batch_size=BATCH, beam_size=beam_size, max_length=MAX_LEN, bos_id=BOS, eos_id=EOS, alpha=0.6)
  whole = decoding.beam_search(step, _first_cache(params), **kwargs)
  per_beam = decoding.beam_search(step, _first_cache(params), **kwargs, logits_sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "tensor")))
  np.testing.assert_array_equal(np.asarray(per_beam.tokens), np.asarray(whole.tokens))
  np.testing.assert_array_equal(np.asarray(per_beam.scores), np.asarray(whole.scores))
  with pytest.raises(ValueError, match="logits_sharding must be None or a NamedSharding"):
    decoding.beam_search(step, _first_cache(params), **kwargs, logits_sharding=jax.sharding.PartitionSpec("tensor"))


def test_beam_search_jits_once_for_repeated_calls():
  calls = chex.assert_max_traces(n=1)(
      lambda table: decoding.beam_search(_markov_step(table), jnp.zeros(2), batch_size=2, beam_size=2,
                                         max_length=4, bos_id=BOS, eos_id=EOS))
  jitted = jax.jit(calls)
  jitted(jnp.asarray(_TRAP))
  jitted(jnp.asarray(_TRAP) * 0.5)


def test_expand_beams_skips_leaves_without_batch_axis():
  cache = {"keys": jnp.arange(6.0).reshape(2, 3), "index": jnp.int32(4)}
  expanded = decoding.expand_beams(cache, 2)
  chex.assert_shape(expanded["keys"], (4, 3))
  np.testing.assert_array_equal(np.asarray(expanded["keys"][1]), np.asarray(cache["keys"][0]))
  assert expanded["index"].shape == ()


@pytest.mark.parametrize("argument, kwargs", [
    ("beam_size", dict(beam_size=0)),
    ("max_length", dict(max_length=0)),
    ("alpha", dict(alpha=-1.0)),
])
def test_beam_search_rejects_bad_arguments(argument, kwargs):
  args = dict(batch_size=1, beam_size=2, max_length=4, bos_id=BOS, eos_id=EOS)
  args.update(kwargs)
  with pytest.raises(ValueError, match=argument):
    decoding.beam_search(_markov_step(_TRAP), jnp.zeros(1), **args)


def test_decode_step_with_wrong_logits_shape_is_rejected():
  bad_step = lambda tokens, cache: (jnp.zeros((tokens.shape[0], VOCAB)), cache)
  with pytest.raises(ValueError, match=r"logits \[2, 1, vocab\]"):
    decoding.greedy_search(bad_step, None, batch_size=2, max_length=3, bos_id=BOS, eos_id=EOS)


def test_integer_arguments_may_be_numpy_integers():
  """ids read from a tokenizer or an array are numpy ints: they used to be refused as 'not an int'."""
  step = _markov_step(_TRAP)
  plain = decoding.greedy_search(step, jnp.zeros(1), batch_size=1, max_length=4, bos_id=BOS, eos_id=EOS)
  numpy_ints = decoding.greedy_search(step, jnp.zeros(1), batch_size=np.int64(1), max_length=np.int32(4),
                                      bos_id=np.int64(BOS), eos_id=np.int64(EOS))
  np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(numpy_ints.tokens))
  with pytest.raises(ValueError, match="eos_id must be an integer >= 0, got True"):
    decoding.greedy_search(step, jnp.zeros(1), batch_size=1, max_length=4, bos_id=BOS, eos_id=True)


def test_beam_slots_no_sequence_can_fill_are_minus_inf_and_padding():
  """Vocabulary 5, one step: 5 sequences exist, so of 8 beams 3 are impossible. They used to come
  back as repeats of real beams with scores near -1e7."""
  beam = decoding.beam_search(_markov_step(np.full((5, 5), 0.2)), jnp.zeros(1), batch_size=1,
                              beam_size=8, max_length=1, bos_id=BOS, eos_id=EOS, alpha=0.0)
  scores, tokens = np.asarray(beam.scores[0]), np.asarray(beam.tokens[0, :, 0])
  np.testing.assert_allclose(scores[:5], np.log(0.2), rtol=1e-5)
  assert sorted(tokens[:5]) == list(range(5))
  assert np.all(scores[5:] == -np.inf) and np.all(tokens[5:] == 0)


class _RoomyCache(dict):
  """A cache saying how many more tokens it takes, as the translator's does."""

  def decode_room(self):
    return 3


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_decoding_past_the_cache_capacity_is_refused(search):
  """Past its capacity a cache attends to nothing and the logits are NaN, which argmax made into
  normal-looking tokens (only the score said NaN)."""
  step = lambda tokens, cache: (jnp.zeros((tokens.shape[0], 1, VOCAB)), cache)
  args = dict(batch_size=1, max_length=4, bos_id=BOS, eos_id=EOS)
  run = (functools.partial(decoding.greedy_search, step, _RoomyCache(), **args) if search == "greedy" else
         functools.partial(decoding.beam_search, step, _RoomyCache(), beam_size=2, **args))
  with pytest.raises(ValueError, match="max_length=4 needs 4 more tokens of cache, but the cache has room for 3"):
    run()


@pytest.mark.parametrize("search", ["greedy", "beam", "sample"])
def test_sequences_that_met_nan_logits_come_back_as_invalid_tokens(search):
  """Under jit a cache's fill index is traced, so decode_room cannot refuse a search that runs past
  the capacity; there the logits turn NaN, and argmax / top_k made ordinary-looking ids of them."""
  def step(tokens, position):  # row 0 goes NaN from its third step on (its cache is "full"); row 1 never
    logits = jnp.tile(jnp.arange(VOCAB, dtype=jnp.float32) == 3, (2, 1)) * 5.0
    logits = logits.at[0].set(jnp.where(position >= 2, jnp.nan, logits[0]))
    return logits[:, None], position + 1

  args = dict(max_length=4, bos_id=BOS, eos_id=EOS)
  if search in ("greedy", "sample"):
    run = (functools.partial(decoding.greedy_search, step, jnp.int32(0)) if search == "greedy" else
           functools.partial(decoding.sample_search, step, jnp.int32(0), rng=jax.random.key(0), top_p=0.9))
    out = jax.jit(lambda: run(batch_size=2, **args))()
    tokens, scores = out.tokens, out.scores
  else:
    out = jax.jit(lambda: decoding.beam_search(step, jnp.int32(0), batch_size=1, beam_size=2,
                                               cache_batch_axis=99, **args))()
    tokens, scores = out.tokens.reshape(-1, 4), out.scores.reshape(-1)
  bad = np.isnan(np.asarray(scores))
  assert bad.any() and (not bad.all() if search != "beam" else True)
  np.testing.assert_array_equal(np.asarray(tokens)[bad], decoding.INVALID_TOKEN)
  assert (np.asarray(tokens)[~bad] >= 0).all()


# --- sampling -------------------------------------------------------------------------------------

def _constant_step(logits):
  """Every step returns the same logits [vocab] for every row."""
  logits = jnp.asarray(logits, jnp.float32)

  def step(tokens, cache):
    return jnp.broadcast_to(logits, (tokens.shape[0], 1, logits.shape[0])), cache

  return step


def _first_draws(logits, rows, seed=0, **options):
  """The first sampled token of `rows` rows, each with its own key, from constant logits."""
  run = jax.jit(lambda keys: decoding.sample_search(_constant_step(logits), jnp.zeros(()), batch_size=rows,
                                                    max_length=1, bos_id=BOS, eos_id=EOS, rng=keys, **options))
  return np.asarray(run(jax.random.split(jax.random.key(seed), rows)).tokens[:, 0])


@functools.partial(jax.jit, static_argnames=("options",))
def _greedy_and_sample(params, keys, options):
  _, step = _sum_model(params)
  common = dict(batch_size=BATCH, max_length=MAX_LEN, bos_id=BOS, eos_id=EOS)
  greedy = decoding.greedy_search(step, _first_cache(params), **common)
  sample = decoding.sample_search(step, _first_cache(params), rng=keys, **dict(options), **common)
  return greedy, sample


@pytest.mark.parametrize("options", [dict(top_k=1), dict(temperature=1e-6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_with_top_k_one_or_tiny_temperature_equals_greedy(options, seed):
  keys = jax.random.split(jax.random.key(seed + 100), BATCH)
  greedy, sample = _greedy_and_sample(_random_params(seed), keys, tuple(options.items()))
  np.testing.assert_array_equal(np.asarray(sample.tokens), np.asarray(greedy.tokens))
  np.testing.assert_allclose(np.asarray(sample.scores), np.asarray(greedy.scores), rtol=1e-6)


def test_a_tiny_temperature_picks_the_best_token_where_the_tempered_logits_overflow():
  """logits / 2e-38 made 9 and 10 both inf, and the draw took the first of them: not greedy, as the docstring says
  small temperatures approach."""
  pick = decoding._sample_pick(jax.random.split(jax.random.key(0), 1), 2e-38, 0, 1.0)
  choice, log_prob = pick(0, jnp.array([[9.0, 10.0, -10.0]]))
  assert int(choice[0]) == 1 and np.isfinite(float(log_prob[0]))


def test_sampled_frequencies_match_the_tempered_softmax():
  """A chi-square test over 20,000 seeded draws: deterministic, and it rejects the untempered softmax."""
  from scipy import stats
  logits, temperature, rows = np.array([0.0, 1.0, 2.0, 0.5, -0.5, 1.5]), 0.7, 20_000
  counts = np.bincount(_first_draws(logits, rows, temperature=temperature), minlength=len(logits))
  softmax = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # float64, so the sums agree
  expected = softmax(logits / temperature) * rows
  assert stats.chisquare(counts, expected).pvalue > 1e-3
  untempered = softmax(logits) * rows
  assert stats.chisquare(counts, untempered).pvalue < 1e-9  # the test can tell temperature was applied


@pytest.mark.parametrize("options, allowed", [
    (dict(top_p=0.81), {0, 1, 2}),        # the mass above token 2 is 0.8, above token 3 0.95
    (dict(top_k=2), {0, 1}),
    (dict(top_k=3, top_p=0.83), {0, 1}),  # the nucleus of the renormalised top 3: above token 2, 0.8 / 0.95
])
def test_top_k_and_top_p_never_emit_a_token_outside_the_kept_set(options, allowed):
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  drawn = set(_first_draws(np.log(probs), 3000, **options).tolist())
  assert drawn == allowed  # nothing outside, and every kept token is drawn


def test_a_rows_sample_depends_only_on_its_own_key():
  table = np.asarray(jax.nn.softmax(jax.random.normal(jax.random.key(3), (VOCAB, VOCAB)), axis=-1))
  keys = jax.random.split(jax.random.key(4), 5)
  search = jax.jit(lambda k: decoding.sample_search(_markov_step(table), jnp.zeros(()), batch_size=k.shape[0],
                                                    max_length=8, bos_id=BOS, eos_id=EOS, rng=k).tokens)
  run = lambda k: np.asarray(search(k))
  together = run(keys)
  assert len({tuple(row) for row in together}) > 1, "rows with different keys should differ"
  np.testing.assert_array_equal(run(keys[2:3])[0], together[2])
  order = np.array([4, 2, 0, 3, 1])
  np.testing.assert_array_equal(run(keys[order]), together[order])


def test_sampling_stops_a_row_at_eos_and_pads_after_it():
  keys = jax.random.split(jax.random.key(5), BATCH)
  _, sample = _greedy_and_sample(_random_params(2), keys, (("temperature", 1.5),))
  tokens = np.asarray(sample.tokens)
  after_eos = np.cumsum(tokens == EOS, axis=1) - (tokens == EOS) > 0
  assert after_eos.any()
  assert (tokens[after_eos] == PAD).all() and (tokens[~after_eos] != PAD).all()


def test_sampling_score_is_the_models_log_probability_of_its_tokens():
  params = _random_params(6)
  full, _ = _sum_model(params)
  _, sample = _greedy_and_sample(params, jax.random.split(jax.random.key(6), BATCH), (("temperature", 1.5),))
  np.testing.assert_allclose(np.asarray(sample.scores), _sequence_log_prob(full, np.asarray(sample.tokens)),
                             rtol=1e-5)


def test_a_single_key_is_split_into_one_key_per_row():
  key = jax.random.key(7)
  step = _constant_step(np.zeros(VOCAB))
  args = dict(batch_size=4, max_length=3, bos_id=BOS, eos_id=EOS)
  single, per_row = jax.jit(lambda: (decoding.sample_search(step, None, rng=key, **args),
                                     decoding.sample_search(step, None, rng=jax.random.split(key, 4), **args)))()
  np.testing.assert_array_equal(np.asarray(single.tokens), np.asarray(per_row.tokens))


def test_search_from_first_tokens_continues_a_prompt_in_the_cache():
  """Greedy from BOS gives g; with BOS and g[0] already in the cache (the prompt), greedy fed g[0]
  first must give g[1:]."""
  params = _random_params(8)
  _, step = _sum_model(params)
  common = dict(batch_size=BATCH, bos_id=BOS, eos_id=EOS)
  whole = np.asarray(decoding.greedy_search(step, _first_cache(params), max_length=MAX_LEN, **common).tokens)
  assert (whole[:, 0] != EOS).all()
  _, prompt_cache = step(jnp.full((BATCH, 1), BOS), _first_cache(params))
  rest = decoding.greedy_search(step, prompt_cache, max_length=MAX_LEN - 1, first_tokens=jnp.asarray(whole[:, 0]),
                                **common)
  np.testing.assert_array_equal(np.asarray(rest.tokens), whole[:, 1:])


def test_beam_search_feeds_first_tokens_to_every_beam():
  """From first token B, the _TRAP chain's best continuation is EOS (0.9); from A it is EOS (0.36)
  against A or B (0.32 each) plus whatever follows."""
  beam = decoding.beam_search(_markov_step(_TRAP), jnp.zeros(2), batch_size=2, beam_size=2, max_length=3,
                              bos_id=BOS, eos_id=EOS, alpha=0.0, first_tokens=jnp.array([4, 3]))
  assert int(beam.tokens[0, 0, 0]) == EOS
  np.testing.assert_allclose(float(beam.scores[0, 0]), np.log(0.9), rtol=1e-5)
  np.testing.assert_allclose(float(beam.scores[1, 0]), np.log(0.36), rtol=1e-5)


@pytest.mark.parametrize("argument, kwargs", [
    ("temperature", dict(temperature=0.0)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=1e-40)),  # flushed to 0 on CPU and GPU
    ("top_k", dict(top_k=-1)),
    ("top_k", dict(top_k=1.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("rng", dict(rng=None)),
    ("rng", dict(rng=jax.random.split(jax.random.key(0), 3))),
    ("first_tokens", dict(first_tokens=jnp.zeros((2, 1), jnp.int32))),
])
def test_sample_search_rejects_bad_arguments(argument, kwargs):
  args = dict(batch_size=2, max_length=4, bos_id=BOS, eos_id=EOS, rng=jax.random.key(0))
  args.update(kwargs)
  with pytest.raises(ValueError, match=argument):
    decoding.sample_search(_markov_step(_TRAP), jnp.zeros(()), **args)


@pytest.mark.parametrize("argument, kwargs", [
    ("method", dict(method="nucleus")),
    ("beam_size", dict(method="beam", beam_size=0)),
    ("alpha", dict(method="beam", alpha=-0.5)),
    ("temperature", dict(method="sample", temperature=-1.0)),
    ("top_p", dict(method="greedy", top_p=2.0)),
    ("cache_halves", dict(method="greedy", cache_halves="no")),
])
def test_decoding_options_reject_bad_values_naming_them(argument, kwargs):
  with pytest.raises(ValueError, match=argument):
    decoding.DecodingOptions(**kwargs)


def test_options_from_a_mapping_read_only_the_option_fields():
  section = {"method": "sample", "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 48, "seed": 3}
  assert decoding.options_from_mapping(section) == decoding.DecodingOptions(method="sample", temperature=0.7,
                                                                           top_p=0.9)
  assert decoding.options_from_mapping({}) == decoding.DecodingOptions()


@pytest.mark.parametrize("field, value", [("method", "nucleus"), ("beam_size", 0), ("top_k", -1), ("top_p", 0.0),
                                          ("cache_halves", 1)])
def test_a_bad_option_in_a_mapping_names_its_field(field, value):
  with pytest.raises(decoding.DecodingOptionError) as error:
    decoding.options_from_mapping({"method": "beam", field: value})
  assert (error.value.field, error.value.value) == (field, value)
  assert isinstance(error.value, ValueError) and field in str(error.value)


def test_decoding_options_are_hashable_and_normalised():
  options = decoding.DecodingOptions(method="sample", top_k=np.int64(5), temperature=1)
  assert options == decoding.DecodingOptions(method="sample", top_k=5, temperature=1.0)
  assert type(options.top_k) is int and type(options.temperature) is float
  assert hash(options) == hash(decoding.DecodingOptions(method="sample", top_k=5))


class _SumEncoderDecoder:
  """The _sum_model behind generate's encoder-decoder interface: the "memory" is the source vector."""

  def __init__(self, params):
    self.params = params
    _, self.step = _sum_model(params)

  def encode(self, inputs):
    return self.params[2][:inputs.shape[0]]

  def init_cache(self, memory, memory_valid, max_length):
    del memory_valid, max_length
    return memory, jnp.int32(0)

  def loop_step(self):
    return self.step


@pytest.mark.parametrize("options", [
    decoding.DecodingOptions(method="beam", beam_size=1, alpha=0.0),
    decoding.DecodingOptions(method="sample", top_k=1),
])
def test_generate_with_options_that_reduce_to_greedy_equals_greedy(options):
  model, inputs = _SumEncoderDecoder(_random_params(9)), jnp.ones((BATCH, 4), jnp.int32)
  common = dict(max_length=MAX_LEN, bos_id=BOS, eos_id=EOS)
  greedy = decoding.generate(model, inputs, **common)
  chosen = decoding.generate(model, inputs, options=options, rng=jax.random.key(1), **common)
  np.testing.assert_array_equal(np.asarray(chosen), np.asarray(greedy))


def test_generate_refuses_beam_arguments_next_to_options():
  model, inputs = _SumEncoderDecoder(_random_params(9)), jnp.ones((BATCH, 4), jnp.int32)
  with pytest.raises(ValueError, match="beam_size=4 / alpha=0.6 were given with options"):
    decoding.generate(model, inputs, max_length=3, bos_id=BOS, eos_id=EOS, beam_size=4,
                      options=decoding.DecodingOptions(method="sample"), rng=jax.random.key(0))


@pytest.mark.parametrize("method", decoding.DECODING_METHODS)
def test_suppressed_ids_are_never_emitted_whatever_the_search(method):
  """A VLM asked about characters its LM never saw wrote 32 unknown pieces ('⁇ ⁇ ...')."""
  logits = jnp.log(jnp.asarray([0.01, 0.01, 1e-9, 0.9, 0.05, 0.03]))  # id 3 (an unknown piece) dominates; no EOS
  options = decoding.DecodingOptions(method=method, beam_size=2)
  run = jax.jit(lambda keys, suppress: decoding.search(
      _constant_step(logits), jnp.zeros(()), options, batch_size=64, max_length=4, bos_id=BOS, eos_id=EOS,
      rng=keys, suppress_ids=suppress), static_argnums=1)
  keys = jax.random.split(jax.random.key(0), 64)
  assert 3 in np.asarray(run(keys, ()).tokens)  # the case the suppression is about
  tokens = np.asarray(run(keys, (PAD, BOS, 3)).tokens)
  assert not np.isin(tokens, [PAD, BOS, 3]).any()  # (no EOS is drawn, so nothing pads)
  if method != "sample":
    assert (tokens == 4).all()  # the best of the rest


def test_suppress_ids_are_checked():
  with pytest.raises(ValueError, match="suppress_ids must be non-negative ints"):
    decoding.suppressing(_constant_step([0.0, 1.0]), (-1,))
  step = decoding.suppressing(_constant_step([0.0, 1.0]), (5,))
  with pytest.raises(ValueError, match=r"suppress_ids \(5,\) reach past the vocabulary of 2"):
    step(jnp.zeros((1, 1), jnp.int32), None)


@pytest.mark.parametrize("max_length, beam_size, alpha", [(5, 8, 2.0), (20, 24, 0.6)])
def test_beam_slots_no_sequence_can_fill_stay_impossible_under_a_length_penalty(max_length, beam_size, alpha):
  """Vocabulary {0, EOS=1}: max_length + 1 sequences exist. The dead slots' -1e7 was divided by the length
  penalty before being told apart from real scores, so past a penalty of 2 they came back as beams of
  garbage tokens scored about -4e6."""
  step = _constant_step(np.log([0.5, 0.5]))
  beam = decoding.beam_search(step, jnp.zeros(1), batch_size=1, beam_size=beam_size, max_length=max_length,
                              bos_id=0, eos_id=1, alpha=alpha)
  scores, tokens = np.asarray(beam.scores[0]), np.asarray(beam.tokens[0])
  real = max_length + 1
  assert np.isfinite(scores[:real]).all() and (scores[:real] > -100).all()
  assert np.all(scores[real:] == -np.inf) and np.all(tokens[real:] == 0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.6", None])
def test_beam_search_refuses_an_alpha_that_is_not_a_finite_number(value):
  """A NaN alpha made every beam's tokens INVALID_TOKEN and a string raised a bare TypeError; DecodingOptions
  already refused both."""
  with pytest.raises(ValueError, match=r"alpha must be a finite number >= 0, got"):
    decoding.beam_search(_markov_step(_TRAP), jnp.zeros(1), batch_size=1, beam_size=2, max_length=3, bos_id=BOS,
                         eos_id=EOS, alpha=value)


@pytest.mark.parametrize("search, argument, value", [
    *[(search, "pad_id", value) for search in ("greedy", "beam", "sample") for value in (-1, True, 1.5)],
    ("beam", "cache_batch_axis", -1), ("beam", "cache_batch_axis", 1.0)])
def test_searches_refuse_a_bad_pad_id_or_cache_batch_axis(search, argument, value):
  """pad_id -1 is INVALID_TOKEN, so padding read as a failed sequence; cache_batch_axis -1 repeated the beams
  along each leaf's last axis."""
  args = dict(batch_size=1, max_length=3, bos_id=BOS, eos_id=EOS, **{argument: value})
  run = {"greedy": decoding.greedy_search,
         "beam": functools.partial(decoding.beam_search, beam_size=2),
         "sample": functools.partial(decoding.sample_search, rng=jax.random.key(0))}[search]
  with pytest.raises(ValueError, match=rf"{argument} must be an integer >= 0, got {value!r}"):
    run(_markov_step(_TRAP), jnp.zeros(1), **args)


def test_expand_beams_checks_its_arguments():
  with pytest.raises(ValueError, match="beam_size must be an integer >= 1, got 0"):
    decoding.expand_beams(jnp.zeros((2, 3)), 0)
  with pytest.raises(ValueError, match="cache_batch_axis must be an integer >= 0, got -1"):
    decoding.expand_beams(jnp.zeros((2, 3)), 2, cache_batch_axis=-1)


def test_decoding_options_take_numpy_floats_as_they_take_numpy_ints():
  """np.float32(0.5) (a value read from an array) was refused as 'must be a finite number > 0'."""
  options = decoding.DecodingOptions(method="sample", temperature=np.float32(0.5), top_p=np.float32(1.0),
                                     alpha=np.float16(0.25), top_k=np.int32(3))
  assert options == decoding.DecodingOptions(method="sample", temperature=0.5, top_p=1.0, alpha=0.25, top_k=3)
  assert type(options.temperature) is float and type(options.top_p) is float


def test_suppress_ids_take_numpy_integers_and_refuse_a_bare_id():
  step = decoding.suppressing(_constant_step([0.0, 1.0, 2.0]), np.array([2]))
  logits, _ = step(jnp.zeros((1, 1), jnp.int32), None)
  assert np.asarray(logits)[0, 0, 2] == -np.inf and np.isfinite(np.asarray(logits)[0, 0, :2]).all()
  with pytest.raises(ValueError, match=r"suppress_ids must be a collection of ids \(ints >= 0\), got 2"):
    decoding.suppressing(_constant_step([0.0, 1.0]), 2)


def test_suppress_ids_that_leave_no_token_are_refused():
  """Every id suppressed made every logit -inf: the searches returned rows of INVALID_TOKEN with no reason."""
  step = decoding.suppressing(_constant_step([0.0, 1.0]), (0, 1))
  with pytest.raises(ValueError, match=r"suppress_ids \(0, 1\) leave none of the vocabulary's 2 ids to emit"):
    step(jnp.zeros((1, 1), jnp.int32), None)


@pytest.mark.parametrize("rng", [np.zeros(4, np.uint32), np.zeros((2, 3), np.uint32)])
def test_raw_keys_of_the_wrong_shape_are_refused_naming_the_shape(rng):
  with pytest.raises(ValueError, match=r"rng must be .*, got uint32\[" + ", ".join(map(str, rng.shape)) + r"\]"):
    decoding.sample_search(_markov_step(_TRAP), jnp.zeros(()), batch_size=2, max_length=3, bos_id=BOS, eos_id=EOS,
                           rng=rng)


def _reference_beam_search(table, example, beam_size, max_length, alpha, bos, eos):
  """Beam search written out in Python over a table model (logits = table[example, step, last token]): each step
  ranks every (beam, token) continuation by log-probability, keeps the best 2k, continues the best k without EOS
  and finishes those ending in EOS among the best k (scored with the GNMT length penalty); it stops once k finished
  hypotheses beat the best live one could reach. -> [(score, tokens)], finished first, then live, best first."""
  penalty = lambda length: ((5.0 + length) / 6.0) ** alpha
  live, finished, steps = [(0.0, [])], [], 0
  for step in range(max_length):
    candidates = []
    for index, (score, tokens) in enumerate(live):
      logits = table[example, step, tokens[-1] if tokens else bos].astype(np.float64)
      log_probs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
      candidates += [(score + log_probs[token], index, token, tokens + [token]) for token in range(len(logits))]
    top = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[:2 * beam_size]
    finished += [(c[0] / penalty(step + 1), c[3]) for c in top[:beam_size] if c[2] == eos]
    finished = sorted(finished, key=lambda f: -f[0])[:beam_size]
    live, steps = [(c[0], c[3]) for c in top if c[2] != eos][:beam_size], step + 1
    reach = live[0][0] / penalty(max_length) if live else -np.inf
    if len(finished) == beam_size and not reach > finished[-1][0]:
      break
  live = sorted(((score / penalty(steps), tokens) for score, tokens in live), key=lambda f: -f[0])
  return (finished + live)[:beam_size]


@pytest.mark.parametrize("vocab,beam_size,max_length,alpha", [(3, 2, 5, 0.6), (3, 4, 4, 2.0), (5, 3, 6, 0.0),
                                                              (2, 7, 5, 2.0), (6, 1, 5, 0.6)])
def test_beam_search_returns_the_beams_of_a_beam_search_written_out_in_python(vocab, beam_size, max_length, alpha):
  """Every returned beam (tokens, padding after EOS, score) against the reference on a table model whose logits
  depend on the example, the step and the last token; EOS made likely enough that beams finish at different steps.
  Slots the reference cannot fill are -inf."""
  bos, eos, pad, batch = 0, 1, 0, 2
  rng = np.random.default_rng(vocab * 100 + beam_size)
  table = (2 * rng.standard_normal((batch, max_length, vocab, vocab))).astype(np.float32)
  table[..., eos] += 0.5

  def step(tokens, cache):  # cache: (step, example ids [batch * beams])
    position, examples = cache
    return jnp.asarray(table)[examples, position, tokens[:, 0]][:, None], (position + 1, examples)

  out = jax.jit(lambda: decoding.beam_search(step, (jnp.int32(0), jnp.arange(batch)), batch_size=batch,
                                             beam_size=beam_size, max_length=max_length, bos_id=bos, eos_id=eos,
                                             pad_id=pad, alpha=alpha))()
  tokens, scores = np.asarray(out.tokens), np.asarray(out.scores)
  for example in range(batch):
    reference = _reference_beam_search(table, example, beam_size, max_length, alpha, bos, eos)
    for slot in range(beam_size):
      if slot >= len(reference):
        assert scores[example, slot] == -np.inf, (example, slot, scores[example])
        continue
      score, expected = reference[slot]
      assert list(tokens[example, slot, :len(expected)]) == expected, (example, slot, tokens[example], reference)
      assert (tokens[example, slot, len(expected):] == pad).all(), tokens[example, slot]
      np.testing.assert_allclose(scores[example, slot], score, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method, field, value", [
    ("greedy", "temperature", 0.7), ("greedy", "top_p", 0.9), ("greedy", "top_k", 5), ("beam", "top_k", 5),
    ("sample", "beam_size", 8), ("greedy", "alpha", 1.0)])
def test_an_option_the_method_does_not_read_set_away_from_its_default_is_named_with_its_reader(method, field, value):
  """A temperature beside method greedy decoded greedily without a word."""
  options = decoding.options_from_mapping({"method": method, field: value})
  (named, readers), = decoding.unread_options(options)
  assert named == field and method not in readers
  assert readers and all(field in decoding.DECODING_METHODS[reader].reads for reader in readers)


_AWAY = {"beam_size": 2, "alpha": 1.0, "temperature": 0.5, "top_k": 3, "top_p": 0.5}  # valid, not defaults


@pytest.mark.parametrize("method", decoding.DECODING_METHODS)
def test_every_option_at_its_default_is_unread_by_no_method(method):
  section = {**decoding.OPTION_DEFAULTS, "method": method, "cache_halves": False}  # cache_halves: every method's
  options = decoding.options_from_mapping(section)
  assert options == decoding.DecodingOptions(method=method, cache_halves=False)
  assert decoding.unread_options(options) == ()
  own = {field: _AWAY[field] for field in decoding.DECODING_METHODS[method].reads}
  assert decoding.unread_options(dataclasses.replace(options, **own)) == ()


def test_each_option_but_method_and_cache_halves_is_read_by_exactly_one_built_in_method():
  read = [field for name in ("greedy", "beam", "sample") for field in decoding.DECODING_METHODS[name].reads]
  assert sorted(read) == sorted(set(decoding.OPTION_FIELDS) - {"method", "cache_halves"})
