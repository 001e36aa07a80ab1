"""Greedy, beam and sampling search over an explicit decoder cache, jitted with `lax.while_loop`.

Every search drives an abstract step function

    decode_step(tokens: int32[batch, 1], cache) -> (logits: float[batch, 1, vocab], cache)

that consumes one target token per sequence and returns the next-token logits and the advanced
cache. The cache is any pytree: for the translator it holds, per decoder layer, the growing
self-attention keys/values and the cross-attention keys/values projected once from the encoder
memory, so no step ever recomputes the memory's projections.

Beam search keeps `beam_size` live hypotheses per example in a flattened `[batch * beams]` batch
(example-major: row `b * beams + k` is beam k of example b). After each step it reorders the cache
by the chosen parent beams. A cache may do both itself: `cache.expand_beams(beam_size)` and
`cache.reorder_beams(parent [batch, beams])` (the translator's keeps the memory's keys / values once
per example and reorders its self-attention caches by index, copying nothing). Any other cache has
its leaves repeated, then gathered, along `cache_batch_axis`; leaves with no such axis (a scalar fill
index, or one stacked per layer) are shared by all rows and pass through.

A cache that can be cut to its first positions (`capacity`, `filled`, `head(n)` and `with_head(head)`:
the translator's, the language model's, the vision-language model's) decodes in two loops once its
capacity reaches 2 * HEAD_MIN_POSITIONS: while its fill stays in the first half, on that half alone
(each step's attention reads half the rows), then on the whole cache. The steps and tokens are the
same; the loop body is compiled twice, and the head is a copy: while it decodes, the whole cache stays
alive beside it (1.5x the cache's memory). `cache_halves=False` (every search's keyword, the option
`DecodingOptions.cache_halves`, a config's `task.decoding.cache_halves`) decodes in one loop.

Sampling draws each token from the softmax of the logits divided by a temperature, restricted to the
top_k most likely tokens and then to the nucleus (the fewest most likely tokens whose probability
reaches top_p). Each row has its own PRNG key, folded with the step, so a row's sample depends only on
its key and its logits, never on the other rows of the batch.

Sequences: `tokens[:, t]` is the token generated at step t (the first token fed, BOS or the last
prompt token, is not included); after EOS every position holds `pad_id`. An eos_id past the vocabulary
is never emitted: every row runs to max_length (what the benchmarks and tests use to time whole decodes).
A prompt is decoded by filling the cache with all of it but its last token, which is then fed first
(`first_tokens`).

`DecodingOptions` names one of `DECODING_METHODS` and its options, validated once (a bad field is a
`DecodingOptionError` naming it); `options_from_mapping` reads them from a plain mapping (a config
section); `search` and `generate` run them. `suppress_ids` (of `search` and `generate`) are ids no
search may emit: a task passes its tokenizer's padding, BOS, unknown piece and line breaks
(`Tokenizer.never_generated_ids`), which a model that has seen little text may otherwise rank first.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xattn_jax import registry

DecodeStep = Callable[[jax.Array, Any], tuple[jax.Array, Any]]

# Large negative score for impossible hypotheses: finite so that arithmetic on it stays finite.
NEG_INF = -1.0e7


class GreedyOutput(NamedTuple):
  """What greedy and sampling return (and `search`, for every method)."""
  tokens: jax.Array  # int32[batch, max_length]; all INVALID_TOKEN on a row whose score is NaN
  scores: jax.Array  # float32[batch]: sum of the chosen tokens' log-probabilities (beam: length-penalised)


# Every token of a sequence whose score is NaN: its logits were NaN at some step (a jitted search run
# past its cache's capacity, which cannot be checked while tracing, or a model that returned NaN).
# argmax / top_k would otherwise turn NaN logits into ordinary-looking token ids.
INVALID_TOKEN = -1


class BeamOutput(NamedTuple):
  tokens: jax.Array  # int32[batch, beams, max_length], best beam first; INVALID_TOKEN where the score is NaN
  scores: jax.Array  # float32[batch, beams]: length-penalised log-probabilities; beams that ended
  # with EOS first, by score, then unfinished ones (max_length reached), by score; -inf (and all
  # padding tokens) for a slot no sequence could fill


def _as_int(name: str, value, low: int) -> int:
  """value as a Python int (numpy integers too), or a ValueError naming the argument."""
  try:
    number = operator.index(value) if not isinstance(value, bool) else None
  except TypeError:
    number = None
  if number is None or number < low:
    raise ValueError(f"decoding: {name} must be an integer >= {low}, got {value!r}")
  return number


def _as_bool(name: str, value) -> bool:
  """value as a Python bool (numpy bools too), or a ValueError naming the argument."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"decoding: {name} must be True or False, got {value!r}")
  return bool(value)


def _check_common(batch_size, max_length, bos_id, eos_id, cache, pad_id=0):
  """The integer arguments as Python ints (pad_id's too: checked, not returned); raises if the cache cannot
  take max_length more tokens. pad_id must be a real id: INVALID_TOKEN (-1) marks a failed sequence.

  A cache may say how many more tokens it accepts with a `decode_room()` method (the translator's
  does); past that, attention reads no keys and the logits are NaN, which argmax would turn into
  ordinary-looking tokens.
  """
  values = tuple(_as_int(name, value, low) for name, value, low in (
      ("batch_size", batch_size, 1), ("max_length", max_length, 1), ("bos_id", bos_id, 0),
      ("eos_id", eos_id, 0)))
  _as_int("pad_id", pad_id, 0)
  room = cache.decode_room() if hasattr(cache, "decode_room") else None
  if room is not None and values[1] > room:
    raise ValueError(f"decoding: max_length={values[1]} needs {values[1]} more tokens of cache, but the "
                     f"cache has room for {room}; build it with a larger capacity (the model's init_cache)")
  return values


def _next_logits(decode_step, tokens, cache, expected_rows):
  """Runs one step on tokens [rows] and returns float32 logits [rows, vocab] and the new cache."""
  logits, cache = decode_step(tokens[:, None], cache)
  if logits.ndim != 3 or logits.shape[:2] != (expected_rows, 1):
    raise ValueError(f"decoding: decode_step must return logits [{expected_rows}, 1, vocab], "
                     f"got logits{list(logits.shape)}")
  return logits[:, 0].astype(jnp.float32), cache


def _argmax_and_log_prob(logits):
  """logits [batch, vocab] -> (first index of the maximum [batch] int32, its log-probability [batch]).

  The same as argmax / take_along_axis over log_softmax, without the log-softmax array and with a
  plain min-reduction instead of XLA's two-output argmax reduction, which is slower on CPU (measured in
  commit b511080's message).
  """
  vocab = logits.shape[-1]
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  choice = jnp.min(jnp.where(logits == row_max, jnp.arange(vocab, dtype=jnp.int32), vocab - 1), axis=-1)
  # log_softmax at the maximum, computed as jax.nn.log_softmax does: (x - max) - log(sum(exp(x - max)))
  # with x - max = 0, so greedy's scores match beam search's to the last bit.
  return choice, -jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1))


def _check_logits_sharding(logits_sharding):
  """logits_sharding as given (None or a NamedSharding of logits [rows, vocab]), or a ValueError."""
  if logits_sharding is None:
    return None
  if not isinstance(logits_sharding, jax.sharding.NamedSharding) or len(logits_sharding.spec) > 2:
    raise ValueError(f"decoding: logits_sharding must be None or a NamedSharding of logits [rows, vocab] (a spec "
                     f"of at most 2 entries), got {logits_sharding!r}")
  return logits_sharding


def _split_top_k(x, k: int, logits_sharding):
  """lax.top_k(x, k) over the last axis of x [rows, ..., vocab], the same values and indices (ties to the
  lower index), where logits_sharding (a NamedSharding of logits [rows, vocab], or None) may split the
  vocabulary over devices.

  XLA's partitioner gathers a top-k's whole operand onto every device when its ranked axis is split; here
  each device ranks its own part of the vocabulary (shard_map) and only those k candidates per shard are
  gathered and ranked again. Parts hold consecutive ids, so candidates in part order tie-break as the whole
  axis does. Rows stay split over the rows' axes where those divide them.
  """
  if logits_sharding is None:
    return lax.top_k(x, k)
  mesh, spec = logits_sharding.mesh, tuple(logits_sharding.spec) + (None,) * (2 - len(logits_sharding.spec))
  axes = [() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry) for entry in spec]
  shards = [math.prod(mesh.shape[a] for a in entry) for entry in axes]
  vocab = x.shape[-1]
  if shards[1] == 1 or vocab % shards[1]:
    return lax.top_k(x, k)
  rows_axes = axes[0] if x.shape[0] % shards[0] == 0 else ()
  part_spec = jax.sharding.PartitionSpec(rows_axes or None, *(None,) * (x.ndim - 2), axes[1])

  def ranked_part(part):  # -> the part's best min(k, part) values and their ids in the whole vocabulary
    values, ids = lax.top_k(part, min(k, part.shape[-1]))
    return values, ids + lax.axis_index(axes[1]).astype(ids.dtype) * part.shape[-1]

  values, ids = jax.shard_map(ranked_part, mesh=mesh, in_specs=part_spec, out_specs=(part_spec, part_spec))(x)
  top, pick = lax.top_k(values, k)  # values [..., shards * min(k, part)]
  return top, jnp.take_along_axis(ids, pick, axis=-1)


# A cache of at least twice this many positions decodes its first half on that half alone (module docstring).
HEAD_MIN_POSITIONS = 32


def _while_in_halves(cond, body, state, at: int, enabled: bool = True):
  """lax.while_loop(cond, body, state), state[at] the cache: where enabled, a cache that can be cut
  (`head`), with room for 2 * HEAD_MIN_POSITIONS or more, runs the steps that fill its first half on that
  half, then the rest on the whole cache. A step fills one position."""
  cache = state[at]
  if (not enabled or not all(hasattr(cache, name) for name in ("capacity", "filled", "head", "with_head"))
      or cache.capacity < 2 * HEAD_MIN_POSITIONS):
    return lax.while_loop(cond, body, state)
  half = cache.capacity // 2
  with_cache = lambda state, cache: state[:at] + (cache,) + state[at + 1:]  # noqa: E731

  def on_head(state):
    whole = state[at]
    state = lax.while_loop(lambda state: cond(state) & (state[at].filled < half), body,
                           with_cache(state, whole.head(half)))
    return with_cache(state, whole.with_head(state[at]))

  # A prompt that already fills the first half (filled >= half) starts on the whole cache.
  state = lax.cond(cache.filled < half, on_head, lambda state: state, state)
  return lax.while_loop(cond, body, state)


def _first_tokens(first_tokens, bos_id: int, rows: int):
  """The tokens fed at step 0: int32 [rows], BOS everywhere when first_tokens is None."""
  if first_tokens is None:
    return jnp.full((rows,), bos_id, jnp.int32)
  first_tokens = jnp.asarray(first_tokens)
  if first_tokens.shape != (rows,) or not jnp.issubdtype(first_tokens.dtype, jnp.integer):
    raise ValueError(f"decoding: first_tokens must be int [{rows}] (one token per row, e.g. each prompt's "
                     f"last), got {first_tokens.dtype}{list(first_tokens.shape)}")
  return first_tokens.astype(jnp.int32)


def _token_by_token(decode_step, cache, pick, *, batch_size, max_length, first, eos_id, pad_id,
                    cache_halves) -> GreedyOutput:
  """The loop greedy and sampling share: one token per row per step, chosen by
  pick(step, logits [batch, vocab]) -> (token [batch] int32, its log-probability [batch]).

  A finished row emits padding and its score stops changing; the loop stops early once every row
  has finished.
  """
  def cond(state):
    step, _, _, _, finished, _ = state
    return jnp.logical_and(step < max_length, jnp.logical_not(jnp.all(finished)))

  def body(state):
    step, last, tokens, scores, finished, cache = state
    logits, cache = _next_logits(decode_step, last, cache, batch_size)  # -> [batch, vocab]
    choice, chosen = pick(step, logits)
    choice = jnp.where(finished, pad_id, choice)
    scores = scores + jnp.where(finished, 0.0, chosen)
    tokens = lax.dynamic_update_slice(tokens, choice[:, None], (0, step))
    finished = finished | (choice == eos_id)
    return step + 1, choice, tokens, scores, finished, cache

  state = (jnp.int32(0), first, jnp.full((batch_size, max_length), pad_id, jnp.int32),
           jnp.zeros((batch_size,), jnp.float32), jnp.zeros((batch_size,), bool), cache)
  _, _, tokens, scores, _, _ = _while_in_halves(cond, body, state, at=5, enabled=cache_halves)
  return GreedyOutput(jnp.where(jnp.isnan(scores)[:, None], INVALID_TOKEN, tokens), scores)


def greedy_search(decode_step: DecodeStep, cache, *, batch_size: int, max_length: int, bos_id: int,
                  eos_id: int, pad_id: int = 0, first_tokens=None, cache_halves: bool = True) -> GreedyOutput:
  """Picks the most likely token at every step until each sequence emits EOS or max_length.

  first_tokens: int [batch], the token each row is fed first (its prompt's last token, the rest of the
  prompt already in the cache); None feeds BOS. The loop stops early once every sequence has finished.
  cache_halves: a long cache's first half decodes on that half alone (module docstring).
  Call inside `jax.jit` (the loop is a `lax.while_loop`; `decode_step` is traced once).
  """
  batch_size, max_length, bos_id, eos_id = _check_common(batch_size, max_length, bos_id, eos_id, cache, pad_id)
  first = _first_tokens(first_tokens, bos_id, batch_size)
  return _token_by_token(decode_step, cache, lambda step, logits: _argmax_and_log_prob(logits),
                         batch_size=batch_size, max_length=max_length, first=first, eos_id=eos_id, pad_id=pad_id,
                         cache_halves=_as_bool("cache_halves", cache_halves))


def _as_float(name: str, value, requirement: str, allowed: Callable[[float], bool]) -> float:
  """value as a finite Python float that satisfies allowed, or a ValueError naming the argument."""
  real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  number = float(value) if real else None
  if number is None or not math.isfinite(number) or not allowed(number):
    raise ValueError(f"decoding: {name} must be {requirement}, got {value!r}")
  return number


def _row_keys(rng, batch_size: int):
  """rng as typed PRNG keys [batch]: one key per row as given, or a single key split into batch_size.

  Raw uint32 keys (jax.random.PRNGKey) are accepted, one [2] or one per row [batch, 2].
  """
  if rng is None:
    raise ValueError("decoding: rng is required for sampling (one PRNG key, or one per row [batch])")
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.dtype != jnp.uint32 or rng.ndim not in (1, 2) or rng.shape[-1] != 2:
      raise ValueError(f"decoding: rng must be a PRNG key (jax.random.key) or one per row [{batch_size}], or raw "
                       f"uint32 key data [2] or [{batch_size}, 2], got {rng.dtype}{list(rng.shape)}")
    rng = jax.random.wrap_key_data(rng)
  if rng.ndim == 0:
    return jax.random.split(rng, batch_size)
  if rng.shape != (batch_size,):
    raise ValueError(f"decoding: rng must be one key or one key per row [{batch_size}], got keys{list(rng.shape)}")
  return rng


def _sample_pick(row_keys, temperature: float, top_k: int, top_p: float, logits_sharding=None):
  """pick(step, logits) for `_token_by_token`: a draw from the tempered, top-k / top-p truncated softmax.

  The returned log-probability is the model's own (log_softmax of the raw logits at the drawn token),
  as greedy's, so the scores of greedy and sampled sequences compare.
  """
  def pick(step, logits):
    vocab = logits.shape[-1]
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)  # -> [batch] keys
    row_max = jnp.max(logits, axis=-1)
    # shifted first: the best logit is 0 whatever the temperature, so a small one gives -inf elsewhere, not inf - inf
    scaled = (logits - row_max[:, None]) / temperature
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
      choice = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    else:
      # Candidates sorted by descending logit; lax.top_k breaks ties by the lower index, as argmax does.
      candidates, ids = _split_top_k(scaled, k, logits_sharding)  # -> [batch, k]
      if top_p < 1.0:
        probs = jax.nn.softmax(candidates, axis=-1)
        # A candidate is in the nucleus when the mass above it is below top_p: the most likely always is.
        mass_above = jnp.cumsum(probs, axis=-1) - probs
        candidates = jnp.where(mass_above < top_p, candidates, -jnp.inf)
      rank = jax.vmap(jax.random.categorical)(keys, candidates)  # -> [batch]
      choice = jnp.take_along_axis(ids, rank[:, None], axis=-1)[:, 0].astype(jnp.int32)
    log_prob = (jnp.take_along_axis(logits, choice[:, None], axis=-1)[:, 0] - row_max
                - jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1)))
    return choice, log_prob

  return pick


def sample_search(decode_step: DecodeStep, cache, *, batch_size: int, max_length: int, bos_id: int,
                  eos_id: int, pad_id: int = 0, rng, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, first_tokens=None, logits_sharding=None,
                  cache_halves: bool = True) -> GreedyOutput:
  """Draws every token from softmax(logits / temperature) within the top_k tokens and the top_p nucleus.

  top_k = 0 (or >= vocab) keeps every token; top_p = 1 keeps the whole (top-k) distribution; the
  nucleus is taken from the top-k tokens' renormalised probabilities. rng: one PRNG key per row
  [batch] (row i's draws depend only on rng[i] and its own logits), or a single key, split into
  batch_size row keys (then a row's draws depend on batch_size too). first_tokens as for greedy.
  Scores are the model's log-probabilities of the drawn tokens (temperature 1, no truncation).
  logits_sharding as for beam search (the top_k candidates ranked per device), cache_halves as for greedy.
  Stops at EOS or max_length; call inside `jax.jit` with the options static.
  """
  batch_size, max_length, bos_id, eos_id = _check_common(batch_size, max_length, bos_id, eos_id, cache, pad_id)
  options = DecodingOptions(method="sample", temperature=temperature, top_k=top_k, top_p=top_p,
                            cache_halves=cache_halves)
  first = _first_tokens(first_tokens, bos_id, batch_size)
  pick = _sample_pick(_row_keys(rng, batch_size), options.temperature, options.top_k, options.top_p,
                      _check_logits_sharding(logits_sharding))
  return _token_by_token(decode_step, cache, pick, batch_size=batch_size, max_length=max_length, first=first,
                         eos_id=eos_id, pad_id=pad_id, cache_halves=options.cache_halves)


def length_penalty(length, alpha: float):
  """GNMT length normalisation ((5 + length) / 6) ** alpha (Wu et al., 2016); 1 when alpha = 0."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _map_rows(fn, cache, axis: int):
  """Applies fn(leaf, axis) to the cache leaves that have a batch axis; others pass through."""
  return jax.tree.map(lambda x: fn(x, axis) if jnp.ndim(x) > axis else x, cache)


def expand_beams(cache, beam_size: int, *, cache_batch_axis: int = 0):
  """The cache for beam_size beams per example: the cache's own `expand_beams(beam_size)` where it has
  one, else each example's rows repeated: [..., batch, ...] -> [..., batch * beams, ...]."""
  beam_size = _as_int("beam_size", beam_size, 1)
  cache_batch_axis = _as_int("cache_batch_axis", cache_batch_axis, 0)
  if hasattr(cache, "expand_beams"):
    return cache.expand_beams(beam_size)
  return _map_rows(lambda x, axis: jnp.repeat(x, beam_size, axis=axis), cache, cache_batch_axis)


def _reorder_beams(cache, parent, batch_size, beam_size, axis):
  """The cache after beam j of every example continues beam parent[b, j] (parent [batch, beams]): the
  cache's own `reorder_beams(parent)` where it has one, else its [batch * beams] rows gathered."""
  if hasattr(cache, "reorder_beams"):
    return cache.reorder_beams(parent)
  rows = (jnp.arange(batch_size)[:, None] * beam_size + parent).reshape(-1)  # -> [batch * beams]
  return _map_rows(lambda x, ax: jnp.take(x, rows, axis=ax), cache, axis)


def beam_search(decode_step: DecodeStep, cache, *, batch_size: int, beam_size: int, max_length: int,
                bos_id: int, eos_id: int, pad_id: int = 0, alpha: float = 0.6,
                cache_batch_axis: int = 0, first_tokens=None, logits_sharding=None,
                cache_halves: bool = True) -> BeamOutput:
  """Beam search with GNMT length penalty and early stopping.

  `cache` is the cache for `batch_size` examples (it is expanded to `batch_size * beam_size` rows
  here, so the memory's keys/values are still projected once per example). Each step scores
  `2 * beam_size` candidates per example. An EOS candidate becomes a finished hypothesis (score =
  log-probability / length_penalty(length, alpha)) only when it ranks within the top `beam_size`
  candidates, so beam_size = 1 with alpha = 0 is exactly greedy search. The remaining best
  non-EOS candidates stay live. The loop stops at max_length, or once no live beam can still beat
  the worst kept finished hypothesis of any example (early stop). Finished hypotheses are
  returned first; when an example has fewer than beam_size of them, its best live beams
  (unfinished at max_length) fill the remaining slots. first_tokens: int [batch], fed first to all of
  an example's beams (None: BOS), as for greedy. logits_sharding: how `decode_step`'s logits [rows, vocab]
  are placed (a NamedSharding; `sharding.logits_sharding` gives the launcher's), or None: where it splits
  the vocabulary over devices (tensor parallelism), each device ranks its own part and only its best
  candidates are gathered, the same beams as unsplit. cache_halves as for greedy.
  """
  batch_size, max_length, bos_id, eos_id = _check_common(batch_size, max_length, bos_id, eos_id, cache, pad_id)
  beam_size = _as_int("beam_size", beam_size, 1)
  alpha = _as_float("alpha", alpha, "a finite number >= 0", lambda x: x >= 0)  # the length penalty's exponent
  cache_batch_axis = _as_int("cache_batch_axis", cache_batch_axis, 0)
  logits_sharding = _check_logits_sharding(logits_sharding)
  cache_halves = _as_bool("cache_halves", cache_halves)
  b, k = batch_size, beam_size
  rows = b * k
  first = _first_tokens(first_tokens, bos_id, b)[:, None]  # -> [batch, 1], the same for every beam
  cache = expand_beams(cache, k, cache_batch_axis=cache_batch_axis)

  def cond(state):
    step, _, live_scores, _, finished_scores, finished_any, _ = state
    # Log-probabilities only fall as a sequence grows; with alpha >= 0 the penalty is largest at
    # max_length, so this bound is the best score any live beam can still reach.
    best_live = live_scores[:, 0] / length_penalty(max_length, alpha)  # -> [batch]
    worst_finished = jnp.where(finished_any[:, -1], finished_scores[:, -1], NEG_INF)
    can_improve = jnp.any(best_live > worst_finished)
    return jnp.logical_and(step < max_length, can_improve)

  def body(state):
    step, live_tokens, live_scores, finished_tokens, finished_scores, finished_any, cache = state
    last = jnp.where(step == 0, first,
                     lax.dynamic_index_in_dim(live_tokens, jnp.maximum(step - 1, 0), axis=2, keepdims=False))
    logits, cache = _next_logits(decode_step, last.reshape(rows), cache, rows)  # -> [batch * beams, vocab]
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits).reshape(b, k, vocab)
    candidates = live_scores[:, :, None] + log_probs  # -> [batch, beams, vocab]
    if logits_sharding is None:
      top_scores, top_ids = lax.top_k(candidates.reshape(b, k * vocab), 2 * k)  # -> [batch, 2 * beams]
      parent, token = top_ids // vocab, (top_ids % vocab).astype(jnp.int32)  # -> [batch, 2 * beams]
    else:
      # Each beam's best tokens first (ranked where the vocabulary lies), then the best of those: in
      # (beam, rank) order, ties go to the lower beam, then the lower token, as over [batch, beams * vocab].
      per_beam = min(2 * k, vocab)
      beam_scores, beam_tokens = _split_top_k(candidates, per_beam, logits_sharding)  # -> [batch, beams, per_beam]
      top_scores, pick = lax.top_k(beam_scores.reshape(b, k * per_beam), 2 * k)  # -> [batch, 2 * beams]
      parent = pick // per_beam
      token = jnp.take_along_axis(beam_tokens.reshape(b, k * per_beam), pick, axis=1).astype(jnp.int32)
    top_tokens = jnp.take_along_axis(live_tokens, parent[:, :, None], axis=1)  # -> [batch, 2 * beams, max_length]
    top_tokens = lax.dynamic_update_slice_in_dim(top_tokens, token[:, :, None], step, axis=2)
    is_eos = token == eos_id

    # Live: the best beam_size candidates that did not end; EOS ones are pushed to the bottom.
    live_candidates = jnp.where(is_eos, NEG_INF, top_scores)
    live_scores, live_rank = lax.top_k(live_candidates, k)  # -> [batch, beams]
    live_tokens = jnp.take_along_axis(top_tokens, live_rank[:, :, None], axis=1)
    cache = _reorder_beams(cache, jnp.take_along_axis(parent, live_rank, axis=1), b, k, cache_batch_axis)

    # Finished: EOS candidates within the top beam_size, merged with earlier finished hypotheses.
    in_top_k = jnp.arange(2 * k)[None, :] < k
    # Candidates grown from the dead initial beams (only when vocab < 2 * beams) never finish.
    new_finished = is_eos & in_top_k & (top_scores > NEG_INF / 2)
    new_scores = jnp.where(new_finished, top_scores / length_penalty(step + 1, alpha), NEG_INF)
    all_scores = jnp.concatenate([finished_scores, new_scores], axis=1)  # -> [batch, 3 * beams]
    all_tokens = jnp.concatenate([finished_tokens, top_tokens], axis=1)
    all_any = jnp.concatenate([finished_any, new_finished], axis=1)
    finished_scores, keep = lax.top_k(all_scores, k)  # -> [batch, beams]
    finished_tokens = jnp.take_along_axis(all_tokens, keep[:, :, None], axis=1)
    finished_any = jnp.take_along_axis(all_any, keep, axis=1)
    return step + 1, live_tokens, live_scores, finished_tokens, finished_scores, finished_any, cache

  # Only beam 0 starts live, so the first step does not pick k copies of the same token.
  live_scores = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1))
  state = (jnp.int32(0), jnp.full((b, k, max_length), pad_id, jnp.int32), live_scores,
           jnp.full((b, k, max_length), pad_id, jnp.int32), jnp.full((b, k), NEG_INF, jnp.float32),
           jnp.zeros((b, k), bool), cache)
  step, live_tokens, live_scores, finished_tokens, finished_scores, finished_any, _ = _while_in_halves(
      cond, body, state, at=6, enabled=cache_halves)
  # Finished hypotheses rank first; live (unfinished at max_length) ones fill the remaining slots.
  # A dead live beam is told by its score before the length penalty divides it: NEG_INF / penalty may
  # rise above NEG_INF / 2 (a penalty over 2: alpha 0.6 from length 15 on).
  live_any = ~(live_scores <= NEG_INF / 2)  # -> [batch, beams]; a NaN one stays, to come back invalid
  live_scores = live_scores / length_penalty(step, alpha)
  rank_key = jnp.concatenate([jnp.where(finished_any, finished_scores, -jnp.inf),
                              live_scores + 2 * NEG_INF], axis=1)  # -> [batch, 2 * beams]
  _, order = lax.top_k(rank_key, k)  # -> [batch, beams]
  tokens = jnp.take_along_axis(jnp.concatenate([finished_tokens, live_tokens], axis=1), order[:, :, None], axis=1)
  scores = jnp.take_along_axis(jnp.concatenate([finished_scores, live_scores], axis=1), order, axis=1)
  # Slots no hypothesis could fill (beam_size above the number of distinct sequences there are, e.g.
  # a vocabulary of 5 and max_length 1) carry -inf and padding instead of repeats of real beams.
  impossible = ~jnp.take_along_axis(jnp.concatenate([finished_any, live_any], axis=1), order, axis=1)
  tokens = jnp.where(impossible[:, :, None], pad_id, tokens)
  return BeamOutput(jnp.where(jnp.isnan(scores)[:, :, None], INVALID_TOKEN, tokens),
                    jnp.where(impossible, -jnp.inf, scores))


class DecodingOptionError(ValueError):
  """A bad DecodingOptions field: `field` names it (a config wrapper reports it as task.decoding.<field>)."""

  def __init__(self, field: str, value, message: str):
    super().__init__(message)
    self.field, self.value = field, value


@dataclasses.dataclass(frozen=True)
class DecodingOptions:
  """A decoding method and its options, validated on construction; hashable, so a static jit argument.

  method: one of DECODING_METHODS; it reads the options its entry's `reads` lists, and cache_halves:
    beam_size    >= 1
    alpha        GNMT length-penalty exponent, >= 0
    temperature  >= float32's smallest normal; small values approach greedy
    top_k        >= 0, 0 = every token
    top_p        in (0, 1], 1 = no nucleus cut
    cache_halves bool: a cache of 2 * HEAD_MIN_POSITIONS positions or more decodes its first half on that half
                 alone, holding 1.5x its memory meanwhile; False: one loop on the whole cache
  Every option is checked whatever the method, so a bad value in a config fails at once; `unread_options` names
  those set away from their defaults that the chosen method does not read.
  """
  method: str = "greedy"
  beam_size: int = 4
  alpha: float = 0.6
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  cache_halves: bool = True

  def __post_init__(self):
    if not isinstance(self.method, str) or self.method not in DECODING_METHODS:
      raise DecodingOptionError("method", self.method, f"decoding: method must be one of "
                                f"{list(DECODING_METHODS)}, got {self.method!r}")
    for name, check in _OPTION_CHECKS.items():
      try:
        value = check(getattr(self, name))
      except ValueError as error:
        raise DecodingOptionError(name, getattr(self, name), str(error)) from None
      object.__setattr__(self, name, value)  # numpy scalars and ints become plain ints / floats


_TINY = float(np.finfo(np.float32).tiny)


# DecodingOptions' numeric fields and their checks (each returns the plain value or raises ValueError).
_OPTION_CHECKS = {
    "beam_size": lambda v: _as_int("beam_size", v, 1),
    "alpha": lambda v: _as_float("alpha", v, "a finite number >= 0", lambda x: x >= 0),
    # float32's smallest normal at least: a smaller one is flushed to 0 on CPU and GPU, and 0 / 0 is NaN
    "temperature": lambda v: _as_float("temperature", v, f"a finite number >= {_TINY:.3g} (float32's smallest normal; "
                                       "method='greedy' is temperature 0)", lambda x: x >= _TINY),
    "top_k": lambda v: _as_int("top_k", v, 0),
    "top_p": lambda v: _as_float("top_p", v, "a number in (0, 1]", lambda x: 0 < x <= 1),
    "cache_halves": lambda v: _as_bool("cache_halves", v),
}
OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(DecodingOptions))
OPTION_DEFAULTS = {field.name: field.default for field in dataclasses.fields(DecodingOptions)}


def options_from_mapping(values) -> DecodingOptions:
  """The DecodingOptions of a plain mapping (a config section): its OPTION_FIELDS keys are read, others
  (a task's own, e.g. max_new_tokens or seed) are not; a missing field takes its default.

  Raises DecodingOptionError (a ValueError) whose `field` names the first bad field, method first.
  """
  return DecodingOptions(**{name: values[name] for name in OPTION_FIELDS if name in values})


def unread_options(options: DecodingOptions) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """(field, the methods that read it) for each option set away from its default that options.method does not
  read (DECODING_METHODS' `reads`): a temperature beside method greedy, which decodes as if it were not there."""
  read = ("method", "cache_halves", *DECODING_METHODS[options.method].reads)
  unread = [field for field in OPTION_FIELDS if field not in read and getattr(options, field) != OPTION_DEFAULTS[field]]
  return tuple((field, tuple(name for name, method in DECODING_METHODS.items() if field in method.reads))
               for field in unread)


def _run_greedy(decode_step, cache, options, rng, *, cache_batch_axis, logits_sharding, **common):
  del rng, cache_batch_axis, logits_sharding  # greedy draws nothing, keeps no beams and ranks nothing
  return greedy_search(decode_step, cache, cache_halves=options.cache_halves, **common)


def _run_beam(decode_step, cache, options, rng, *, cache_batch_axis, logits_sharding, **common):
  del rng
  beams = beam_search(decode_step, cache, beam_size=options.beam_size, alpha=options.alpha,
                      cache_batch_axis=cache_batch_axis, logits_sharding=logits_sharding,
                      cache_halves=options.cache_halves, **common)
  return GreedyOutput(beams.tokens[:, 0], beams.scores[:, 0])  # the best beam


def _run_sample(decode_step, cache, options, rng, *, cache_batch_axis, logits_sharding, **common):
  del cache_batch_axis  # each row samples alone: no beams
  return sample_search(decode_step, cache, rng=rng, temperature=options.temperature, top_k=options.top_k,
                       top_p=options.top_p, logits_sharding=logits_sharding, cache_halves=options.cache_halves,
                       **common)


@dataclasses.dataclass(frozen=True)
class DecodingMethod:
  """One decoding method: what runs it and the DecodingOptions fields it reads.

  run: (decode_step, cache, options, rng, *, batch_size, max_length, bos_id, eos_id, pad_id, first_tokens,
    cache_batch_axis, logits_sharding) -> GreedyOutput(tokens [batch, max_length], scores [batch]); `search`'s
    arguments (rng: one key, or one per row, or None).
  reads: the DecodingOptions fields it reads besides method and cache_halves (which every method is handed).
  draws: whether run draws from rng (the tasks' keys come from task.decoding.seed, which a method that draws nothing
    leaves unread: `decoding_config` says so where it is set).
  """
  run: Callable[..., GreedyOutput]
  reads: tuple[str, ...] = ()
  draws: bool = False


# The decoding methods: the names configs choose from (read when checked, so registered ones count), and what
# runs each.
DECODING_METHODS: dict[str, DecodingMethod] = {
    "greedy": DecodingMethod(_run_greedy),
    "beam": DecodingMethod(_run_beam, reads=("beam_size", "alpha")),
    "sample": DecodingMethod(_run_sample, reads=("temperature", "top_k", "top_p"), draws=True),
}


def register_decoding_method(name: str, run: Callable[..., GreedyOutput], *, reads: tuple[str, ...] = (),
                             draws: bool = False, replace: bool = False) -> None:
  """Adds `run` to DECODING_METHODS as `name`: DecodingOptions, `search`, `generate` and the tasks'
  task.decoding.method take it from then on (see DecodingMethod for run's arguments, `reads` and `draws`).

  Register it before the config is validated: a run of launch.py registers it from a module its config file
  imports. ValueError for a name that is not a non-empty str, or is registered already (unless replace), a run
  that is not callable, reads that are not DecodingOptions fields, or draws that is not a bool.
  """
  registry.check_new_name("register_decoding_method", DECODING_METHODS, name, replace=replace)
  if not callable(run):
    raise ValueError(f"register_decoding_method: run must be callable, got {type(run).__name__}")
  fields = [field for field in OPTION_FIELDS if field not in ("method", "cache_halves")]
  if isinstance(reads, str) or not isinstance(reads, (tuple, list)) or not set(reads) <= set(fields):
    raise ValueError(f"register_decoding_method: reads must be a tuple of DecodingOptions fields from {fields}, "
                     f"got reads={reads!r}")
  if not isinstance(draws, bool):
    raise ValueError(f"register_decoding_method: draws must be a bool (True: run draws from rng), got draws={draws!r}")
  registry.add("register_decoding_method", DECODING_METHODS, name, DecodingMethod(run, tuple(reads), draws))


def suppressing(decode_step: DecodeStep, suppress_ids) -> DecodeStep:
  """decode_step whose logits at `suppress_ids` are -inf: no search picks them, and the others'
  probabilities are renormalized without them."""
  try:
    ids = tuple(suppress_ids)
  except TypeError:
    raise ValueError(f"decoding: suppress_ids must be a collection of ids (ints >= 0), got {suppress_ids!r}") from None
  if any(isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids):
    raise ValueError(f"decoding: suppress_ids must be non-negative ints, got {ids!r}")
  ids = tuple(int(i) for i in ids)  # numpy integers (an array's ids) as plain ints
  if not ids:
    return decode_step
  banned = sorted(set(ids))

  def step(tokens, cache):
    logits, cache = decode_step(tokens, cache)  # -> [batch, 1, vocab]
    if banned[-1] >= logits.shape[-1]:
      raise ValueError(f"decoding: suppress_ids {ids!r} reach past the vocabulary of {logits.shape[-1]}")
    if len(banned) == logits.shape[-1]:  # every logit -inf: each row would come back INVALID_TOKEN
      raise ValueError(f"decoding: suppress_ids {ids!r} leave none of the vocabulary's {logits.shape[-1]} ids to emit")
    return logits.at[..., jnp.asarray(banned, jnp.int32)].set(-jnp.inf), cache

  return step


def search(decode_step: DecodeStep, cache, options: DecodingOptions, *, batch_size: int, max_length: int,
           bos_id: int, eos_id: int, pad_id: int = 0, rng=None, first_tokens=None,
           cache_batch_axis: int = 0, suppress_ids: tuple[int, ...] = (), logits_sharding=None) -> GreedyOutput:
  """Runs options.method: tokens [batch, max_length] and scores [batch] (beam: its best beam's).

  rng (one key, or one per row) is needed by a method that draws (DecodingMethod.draws: "sample") only;
  cache_batch_axis is beam's;
  a registered method (register_decoding_method) gets them all;
  suppress_ids are never emitted (`suppressing`); logits_sharding (beam and sample's top_k: see
  beam_search) changes where candidates are ranked, never which.
  """
  if not isinstance(options, DecodingOptions):
    raise ValueError(f"decoding: options must be a DecodingOptions, got {type(options).__name__}")
  decode_step = suppressing(decode_step, suppress_ids)
  out = DECODING_METHODS[options.method].run(
      decode_step, cache, options, rng, batch_size=batch_size, max_length=max_length, bos_id=bos_id,
      eos_id=eos_id, pad_id=pad_id, first_tokens=first_tokens, cache_batch_axis=cache_batch_axis,
      logits_sharding=logits_sharding)
  if not isinstance(out, GreedyOutput) or jnp.shape(out.tokens) != (batch_size, max_length) \
      or jnp.shape(out.scores) != (batch_size,):
    raise ValueError(f"decoding: method {options.method!r} must return GreedyOutput(tokens [batch_size, max_length]="
                     f"[{batch_size}, {max_length}], scores [{batch_size}]), got {type(out).__name__} with shapes "
                     f"{[list(jnp.shape(x)) for x in out] if isinstance(out, tuple) else None}")
  return out


def generate(model, inputs, *, max_length: int, bos_id: int, eos_id: int, pad_id: int = 0, beam_size: int = 1,
             alpha: float = 0.6, options: DecodingOptions | None = None, rng=None,
             suppress_ids: tuple[int, ...] = (), logits_sharding=None):
  """Encoder-decoder generation: inputs int[b, s] -> tokens [b, max_length] (EOS then padding).

  `model` is any encoder-decoder with `encode(inputs) -> memory`, `init_cache(memory, memory_valid,
  max_length)` and `loop_step() -> DecodeStep` (the translator). The memory is encoded and its
  cross-attention keys / values projected once; the search then runs as one `lax.while_loop` over the
  step. `options` chooses the method (greedy, beam: its best beam, sample: needs `rng`, one key or one
  per row); without it, greedy when beam_size = 1 and beam search with beam_size and alpha otherwise.
  suppress_ids are never emitted; logits_sharding as for `search`. Wrap in `nnx.jit` with max_length, the
  ids, beam_size, alpha, options, suppress_ids and logits_sharding static.
  """
  if options is None:
    options = DecodingOptions(method="greedy" if beam_size == 1 else "beam", beam_size=beam_size, alpha=alpha)
  elif (beam_size, alpha) != (1, 0.6):
    raise ValueError(f"generate: beam_size={beam_size!r} / alpha={alpha!r} were given with options; give them "
                     f"inside options (DecodingOptions(method='beam', beam_size=..., alpha=...)) only")
  if getattr(inputs, "ndim", None) != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"generate: inputs must be int [batch, length], got {getattr(inputs, 'dtype', type(inputs))}"
                     f"{list(getattr(inputs, 'shape', ()))}")
  memory = model.encode(inputs)  # -> [b, s, encoder.d_model]
  cache = model.init_cache(memory, inputs != pad_id, max_length)
  return search(model.loop_step(), cache, options, batch_size=inputs.shape[0], max_length=max_length,
                bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, rng=rng, suppress_ids=suppress_ids,
                logits_sharding=logits_sharding).tokens
