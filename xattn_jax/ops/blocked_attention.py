"""Attention computed block by block, with a custom VJP that recomputes blocks in the backward.

The work is cut into units (one batch element and one kv head, with the `groups` query heads that
share it) and, inside a unit, into query blocks and key blocks. On CPU a loop takes
`units_per_step` units per step, which XLA runs side by side on its threads, and only
their blocks of scores [groups, block_q, block_k] exist at a time, so they stay in cache; the
memory of forward and backward is linear in the sequence length (flash-attention style: the
forward keeps only the output and the log-sum-exp of every query row; the backward recomputes the
probabilities).

With `block_k >= kv_len` the softmax over keys is done in one pass (the dense "xla" path); with a
smaller `block_k` an online softmax runs over the key blocks (the "chunked" path).

The kernel reads every unit's rows straight out of the [batch, length, heads, head_dim] arrays
and writes its results straight into arrays of that layout: no head-major copy of the queries,
keys, values, output or gradients is made. Keys and values may also come in a decode cache's
[batch, kv_heads, length, head_dim] layout (`kv_heads_major`), read as they are. On CPU strided
reads cost less than full-size transposes and their temporaries. Only the GPU / TPU schedule
(`Blocking.parallel_units`), which vmaps all units, transposes them to head-major once.

Masks never need to be materialized at [q, kv]: causal masking is built inside each block from
positions (query i sits at `kv_len - q_len + i`, key j at j), and a boolean mask or bias keeps its
own broadcast shape, so only the block it covers is sliced out.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from xattn_jax.ops import masks as masks_lib


@dataclasses.dataclass(frozen=True)
class Blocking:
  """Static work split: query rows and keys per block, and how units are scheduled.

  parallel_units=False runs the units in a loop, units_per_step of them per step (CPU). Units of
  one query block by one key block are separate straight-line computations in the step, which
  XLA:CPU's executor runs concurrently on its threads; units with block loops are vmapped, so each
  of their matmuls is one batched matmul, spread over the threads one unit per thread. One unit
  per step splits each (small) matmul across the threads instead. units_per_step must divide
  batch * kv_heads. parallel_units=True runs all units side by side (vmapped: one batched matmul
  per key block, for GPU / TPU) with one query block spanning every query; memory stays linear in
  length through the key blocks.

  backward_block_q: query rows per block in the backward pass (None: block_q). A backward block holds
  about twice the forward's score-sized temporaries (scores, probabilities and both their gradients,
  against scores and probabilities), so it can take fewer rows than the forward's. Used with units in a
  loop (parallel_units=False) where it divides the padded query length; block_q otherwise. Units of one
  forward block then have block loops in the backward, which runs them vmapped.
  """
  block_q: int
  block_k: int
  parallel_units: bool = False
  units_per_step: int = 1
  backward_block_q: int | None = None


@dataclasses.dataclass(frozen=True)
class _Static:
  blocking: Blocking
  is_causal: bool
  kv_len: int  # unpadded; keys at positions >= kv_len are padding added to fill the last block
  kv_heads: int
  may_hide_rows: bool  # some query row may see no key (masks, biases, causal with q_len > kv_len)
  kv_heads_major: bool = False  # key / value (and their gradients) [batch, kv_heads, kv_len, head_dim]
  query_offset: int = 0  # causal: query i sits at key position query_offset + i (kv_len - q_len)
  scale: float = 1.0  # score scale, applied to each block's query rows (1.0: the query came scaled)
  scale_scores: bool = False  # apply scale to the float32 scores instead (half-precision queries)

  @property
  def one_block(self) -> bool:
    """Whether a unit is one query block by one key block (no block loops)."""
    q_len = self.kv_len - self.query_offset
    return self.blocking.block_q >= q_len and self.blocking.block_k >= self.kv_len


def _pad_axis(x, axis: int, size: int, value=0):
  if x is None or x.shape[axis] in (1, size):
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _unit_slice(x, batch_index, head_index):
  """x [B', K', G', T', S'] (B', K' each 1 or full) -> [G', T', S'] for one unit."""
  if x is None:
    return None
  x = x[batch_index] if x.shape[0] > 1 else x[0]
  return x[head_index] if x.shape[0] > 1 else x[0]


def _block_slice(x, q_start, k_start, block_q, block_k):
  """x [G', T', S'] -> [G', block_q | 1, block_k | 1]: the part a score block sees."""
  if x is None:
    return None
  if x.shape[1] > 1:
    x = lax.dynamic_slice_in_dim(x, q_start, block_q, axis=1)
  if x.shape[2] > 1:
    x = lax.dynamic_slice_in_dim(x, k_start, block_k, axis=2)
  return x


def _scores(q_rows, k_blk, mask_u, bias_u, q_start, k_start, st: _Static, keys_first: bool = False):
  """Masked float32 scores [groups * block_q, block_k] (-inf where masked); q_rows is pre-scaled.
  keys_first: the same transposed, [block_k, groups * block_q], computed as such (the backward's).

  Query rows are [groups * block_q, head_dim]: 2-D matmuls and row reductions run faster on CPU
  than with a separate groups axis; masks see the free reshape to [groups, block_q, block_k].
  """
  bq, bk = st.blocking.block_q, st.blocking.block_k
  if keys_first:
    s = jnp.einsum("kh,qh->kq", k_blk, q_rows, preferred_element_type=jnp.float32)
  else:
    s = jnp.einsum("qh,kh->qk", q_rows, k_blk, preferred_element_type=jnp.float32)
  if st.scale_scores:
    s = s * st.scale
  if bias_u is None and mask_u is None and not st.is_causal and st.kv_len % bk == 0:
    return s
  # Masks and bias come as [G' | 1, block_q | 1, block_k | 1] blocks; keys_first puts keys first.
  layout = (lambda x: x.transpose(2, 0, 1)) if keys_first else (lambda x: x)
  s = s.reshape((bk, -1, bq) if keys_first else (-1, bq, bk))
  bias_blk = _block_slice(bias_u, q_start, k_start, bq, bk)
  if bias_blk is not None:
    s = s + layout(bias_blk).astype(jnp.float32)
  key_positions = k_start + jnp.arange(bk)  # [block_k]
  valid = None
  if st.kv_len % bk:
    valid = key_positions[None, None, :] < st.kv_len  # padding keys added to fill the last block
  if st.is_causal:
    query_positions = st.query_offset + q_start + jnp.arange(bq)  # [block_q]
    causal = key_positions[None, None, :] <= query_positions[None, :, None]
    valid = causal if valid is None else valid & causal
  mask_blk = _block_slice(mask_u, q_start, k_start, bq, bk)
  if mask_blk is not None:
    valid = mask_blk if valid is None else valid & mask_blk
  if valid is not None:
    s = jnp.where(layout(valid), s, -jnp.inf)
  return s.reshape(s.shape[0], -1) if keys_first else s.reshape(-1, bk)


def _finite_or_zero(row_max, st: _Static):
  """A row with no visible key keeps max -inf; 0 in its place makes exp() give 0, not NaN."""
  return jnp.where(jnp.isfinite(row_max), row_max, 0.0) if st.may_hide_rows else row_max


def _over_key_blocks(q_start, st: _Static, num_key_blocks: int, step, init):
  """`lax.fori_loop(0, n, step, init)` over the n leading key blocks a query block can see.

  Causal attention skips the key blocks above the diagonal. The trip count is always a Python int,
  so the loop lowers to a `scan`, which reverse mode differentiates (grad of grad); with a traced
  q_start (inside the loop over query blocks) the loop spans every key block and a `cond` skips
  those the query block cannot see.
  """
  if not st.is_causal or st.blocking.parallel_units:  # one query block sees every key block
    return lax.fori_loop(0, num_key_blocks, step, init)
  needed = (st.query_offset + q_start + st.blocking.block_q - 1) // st.blocking.block_k + 1
  if isinstance(needed, int):
    return lax.fori_loop(0, min(max(needed, 0), num_key_blocks), step, init)
  skip = lambda kb, carry: carry
  return lax.fori_loop(0, num_key_blocks, lambda kb, carry: lax.cond(kb < needed, step, skip, kb, carry), init)


def _rows(x_blk):
  """[block_q, groups, ...] -> [groups * block_q, ...]: the query rows of a block, group-major."""
  return jnp.moveaxis(x_blk, 1, 0).reshape(-1, *x_blk.shape[2:])


def _query_rows(q_blk, st: _Static):
  """A query block's rows, times the score scale (XLA drops a scale of 1.0): scaled block by block,
  the queries need no scaled copy, nor the backward a separate dq * scale pass."""
  rows = _rows(q_blk)
  return rows if st.scale_scores else rows * jnp.asarray(st.scale, rows.dtype)


def _unrows(rows, groups: int):
  """[groups * block_q, ...] -> [block_q, groups, ...]."""
  return jnp.moveaxis(rows.reshape(groups, -1, *rows.shape[1:]), 0, 1)


def _forward_block(q_rows, k_u, v_u, mask_u, bias_u, q_start, st: _Static):
  """One query block of a unit: rows [groups * block_q, head_dim] -> out rows (float32), lse [groups * block_q]."""
  bk = st.blocking.block_k
  num_key_blocks = k_u.shape[0] // bk

  def step(kb, carry):
    row_max, row_sum, acc = carry
    k_start = kb * bk
    k_blk = lax.dynamic_slice_in_dim(k_u, k_start, bk)
    v_blk = lax.dynamic_slice_in_dim(v_u, k_start, bk)
    s = _scores(q_rows, k_blk, mask_u, bias_u, q_start, k_start, st)
    new_max = jnp.maximum(row_max, s.max(axis=-1))
    # A row with no visible key so far keeps max -inf; use 0 so exp() gives 0, not NaN.
    safe_max = _finite_or_zero(new_max, st)
    p = jnp.exp(s - safe_max[..., None])  # [groups * block_q, block_k]
    rescale = jnp.exp(row_max - safe_max)
    row_sum = row_sum * rescale + p.sum(axis=-1)
    pv = jnp.einsum("qk,kh->qh", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return new_max, row_sum, acc * rescale[..., None] + pv

  if num_key_blocks == 1:
    # One pass: no running maximum to correct.
    s = _scores(q_rows, k_u, mask_u, bias_u, q_start, 0, st)
    row_max = s.max(axis=-1)
    p = jnp.exp(s - _finite_or_zero(row_max, st)[..., None])
    row_sum = p.sum(axis=-1)
    acc = jnp.einsum("qk,kh->qh", p.astype(v_u.dtype), v_u, preferred_element_type=jnp.float32)
  else:
    rows, h = q_rows.shape
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, h), jnp.float32))
    row_max, row_sum, acc = _over_key_blocks(q_start, st, num_key_blocks, step, init)
  if not st.may_hide_rows:  # every row saw a key: no guards (a measurable part of the forward)
    return acc / row_sum[..., None], row_max + jnp.log(row_sum)
  # A query that sees no key (sum exactly 0) returns zeros; lse=+inf makes its recomputed probabilities 0. A NaN
  # sum (NaN scores or values) counts as seen, so the NaN reaches the output as it does without a mask.
  seen = row_sum != 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, row_sum, 1.0)[..., None], 0.0)
  return out, jnp.where(seen, _finite_or_zero(row_max, st) + jnp.log(row_sum), jnp.inf)


def _unit_forward(q_u, k_u, v_u, mask_u, bias_u, st: _Static):
  """One unit: q_u [q_len_padded, groups, head_dim], k_u, v_u [kv_len_padded, head_dim]
  -> out_u like q_u, lse_u [q_len_padded, groups] (float32)."""
  bq = st.blocking.block_q
  groups = q_u.shape[1]

  def block(q_start, q_blk):
    out_rows, lse_rows = _forward_block(_query_rows(q_blk, st), k_u, v_u, mask_u, bias_u, q_start, st)
    return _unrows(out_rows, groups).astype(q_u.dtype), _unrows(lse_rows, groups)

  num_q_blocks = q_u.shape[0] // bq
  if num_q_blocks == 1:
    return block(0, q_u)

  def step(qi, carry):
    out_u, lse_u = carry
    out_blk, lse_blk = block(qi * bq, lax.dynamic_slice_in_dim(q_u, qi * bq, bq))
    return (lax.dynamic_update_slice_in_dim(out_u, out_blk, qi * bq, axis=0),
            lax.dynamic_update_slice_in_dim(lse_u, lse_blk, qi * bq, axis=0))

  init = (jnp.zeros(q_u.shape, q_u.dtype), jnp.zeros(q_u.shape[:2], jnp.float32))
  return lax.fori_loop(0, num_q_blocks, step, init)


def _unit_backward(q_u, o_grad_u, lse_u, delta_u, k_u, v_u, mask_u, bias_u, st: _Static):
  """Gradients of one unit. q_u, o_grad_u [q_len_padded, groups, head_dim]; lse_u, delta_u
  [q_len_padded, groups]; k_u, v_u [kv_len_padded, head_dim]
  -> dq_u like q_u (its dtype), dk_u, dv_u [kv_len_padded, head_dim] (float32), dbias_u or None.

  Score blocks are [block_k, groups * block_q] here (keys first), transposed from the forward's: the
  matmuls are "kh,qh->kq" for scores and dp, plain "kq,qh->kh" products for dk and dv, and
  "kq,kh->hq" for dq (accumulated transposed, [head_dim, rows]). Query-first blocks would make the dk
  and dv matmuls contract the blocks' leading axis: slower on CPU for one-block units, no faster
  for long sequences.
  """
  bq, bk = st.blocking.block_q, st.blocking.block_k
  num_key_blocks = k_u.shape[0] // bk
  groups = q_u.shape[1]

  def key_step(kb, carry, q_rows, do_rows, lse_rows, delta_rows, q_start):
    dq_t, dk_u, dv_u, dbias = carry
    k_start = kb * bk
    k_blk = k_u if num_key_blocks == 1 else lax.dynamic_slice_in_dim(k_u, k_start, bk)
    v_blk = v_u if num_key_blocks == 1 else lax.dynamic_slice_in_dim(v_u, k_start, bk)
    s_t = _scores(q_rows, k_blk, mask_u, bias_u, q_start, k_start, st, keys_first=True)
    p_t = jnp.exp(s_t - lse_rows[None, :])  # [block_k, groups * block_q]
    dp_t = jnp.einsum("kh,qh->kq", v_blk, do_rows, preferred_element_type=jnp.float32)
    ds_t = p_t * (dp_t - delta_rows[None, :])  # d loss / d scores
    ds_low = ds_t.astype(q_rows.dtype)
    dq_t = dq_t + jnp.einsum("kq,kh->hq", ds_low, k_blk, preferred_element_type=jnp.float32)
    dv_blk = jnp.einsum("kq,qh->kh", p_t.astype(do_rows.dtype), do_rows, preferred_element_type=jnp.float32)
    dk_blk = jnp.einsum("kq,qh->kh", ds_low, q_rows, preferred_element_type=jnp.float32)
    if st.scale_scores:  # the rows came unscaled
      dk_blk = dk_blk * st.scale
    add = lambda acc, blk: lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, k_start, bk) + blk, k_start, axis=0)
    dk_u, dv_u = add(dk_u, dk_blk), add(dv_u, dv_blk)
    if dbias is not None:
      # Sum ds over the axes the bias broadcasts along, then add into the bias's own block.
      g_, t_, s_ = dbias.shape
      ds = ds_t.reshape(bk, -1, bq).transpose(1, 2, 0)  # [groups, block_q, block_k]
      part = ds.sum(axis=tuple(a for a, n in enumerate((g_, t_, s_)) if n == 1), keepdims=True)
      starts = (0, q_start if t_ > 1 else 0, k_start if s_ > 1 else 0)
      dbias = lax.dynamic_update_slice(dbias, lax.dynamic_slice(dbias, starts, part.shape) + part, starts)
    return dq_t, dk_u, dv_u, dbias

  def query_step(qi, carry):
    dq_u, dk_u, dv_u, dbias = carry
    q_start = qi * bq
    q_block = lambda x: lax.dynamic_slice_in_dim(x, q_start, bq)
    block = lambda x: _rows(q_block(x))
    q_rows = _query_rows(q_block(q_u), st)
    step = functools.partial(key_step, q_rows=q_rows, do_rows=block(o_grad_u), lse_rows=block(lse_u),
                             delta_rows=block(delta_u), q_start=q_start)
    init = (jnp.zeros(q_rows.shape[::-1], jnp.float32), dk_u, dv_u, dbias)
    if num_key_blocks == 1:
      dq_t, dk_u, dv_u, dbias = step(0, init)
    else:
      dq_t, dk_u, dv_u, dbias = _over_key_blocks(q_start, st, num_key_blocks, step, init)
    dq_blk = _unrows(dq_t.T * st.scale, groups).astype(dq_u.dtype)
    return lax.dynamic_update_slice_in_dim(dq_u, dq_blk, q_start, axis=0), dk_u, dv_u, dbias

  dbias0 = None if bias_u is None else jnp.zeros(bias_u.shape, jnp.float32)
  init = (jnp.zeros(q_u.shape, q_u.dtype), jnp.zeros(k_u.shape, jnp.float32), jnp.zeros(v_u.shape, jnp.float32),
          dbias0)
  num_q_blocks = q_u.shape[0] // bq
  if num_q_blocks == 1:
    return query_step(0, init)
  return lax.fori_loop(0, num_q_blocks, query_step, init)


def _map_units(unit_fn, arrays, results_like, st: _Static, acc_like=None, heads_major=((), ())):
  """Runs `unit_fn(unit, *parts)` for every (batch, kv head) unit and assembles its results.

  arrays and results_like are [batch, length, (kv_heads groups), ...]; a unit's part of each is
  [length, groups, ...]. The arrays and results whose indices heads_major = (array indices,
  result indices) names are [batch, kv_heads, length, ...] instead (one group: part
  [length, 1, ...]), the layout of a decode cache's keys and values. unit_fn returns (result
  parts, acc part): each result part goes to its place in a result, acc parts (None or
  [G', T', S'] per unit) are summed into an accumulator shaped acc_like [B', K', G', T', S']
  (B', K' each 1 or full) at the unit's (batch, kv head).

  Units in a loop (CPU) read their parts straight out of the arrays and write their results in
  place; with units_per_step > 1 unit_fn runs once per unit of the step if units are one block
  (`_Static.one_block`), else the step's parts are stacked and unit_fn is vmapped over them.
  Units side by side (`parallel_units`, vmapped) see head-major copies.
  """
  batch, kv_heads = arrays[0].shape[0], st.kv_heads
  arrays_hm = [i in heads_major[0] for i in range(len(arrays))]
  results_hm = [i in heads_major[1] for i in range(len(results_like))]

  def where(x, unit, hm):  # start indices of a unit's part of x
    if hm:
      return (unit // kv_heads, unit % kv_heads) + (0,) * (x.ndim - 2)
    groups = x.shape[2] // kv_heads
    return (unit // kv_heads, 0, unit % kv_heads * groups) + (0,) * (x.ndim - 3)

  def part(x, unit, hm):  # a strided copy: [length, groups, ...]
    if hm:
      return lax.dynamic_slice(x, where(x, unit, hm), (1, 1, *x.shape[2:]))[0, 0][:, None]
    sizes = (1, x.shape[1], x.shape[2] // kv_heads, *x.shape[3:])
    return lax.dynamic_slice(x, where(x, unit, hm), sizes)[0]

  def put(r, p, unit, hm):  # writes a unit's result part in place
    p = p[:, 0][None, None] if hm else p[None]
    return lax.dynamic_update_slice(r, p.astype(r.dtype), where(r, unit, hm))

  if st.blocking.parallel_units:
    def to_units(x, hm):  # [b, t, (k g), ...] or [b, k, t, ...] -> [(b k), t, g, ...]
      if hm:
        return x.reshape(batch * kv_heads, x.shape[2], 1, *x.shape[3:])
      x = x.reshape(batch, x.shape[1], kv_heads, -1, *x.shape[3:])
      return jnp.moveaxis(x, 2, 1).reshape(batch * kv_heads, *x.shape[1:2], *x.shape[3:])

    def from_units(x, like, hm):  # inverse of to_units
      if not hm:
        x = jnp.moveaxis(x.reshape(batch, kv_heads, *x.shape[1:]), 1, 2)
      return x.reshape(like.shape).astype(like.dtype)

    parts, acc = jax.vmap(unit_fn)(jnp.arange(batch * kv_heads), *map(to_units, arrays, arrays_hm))
    results = tuple(map(from_units, parts, results_like, results_hm))
    if acc_like is not None:  # [(b k), G', T', S'] -> the accumulator's broadcast shape
      acc = acc.reshape(batch, kv_heads, *acc.shape[1:])
      acc = acc.sum(axis=tuple(a for a in (0, 1) if acc_like.shape[a] == 1), keepdims=True)
    return results, acc

  per_step = st.blocking.units_per_step

  def step(i, carry):
    results, acc = carry
    units = [i * per_step + j for j in range(per_step)]
    if per_step == 1 or st.one_block:
      # One computation per unit: units without block loops are independent straight-line
      # programs that XLA:CPU runs side by side on its threads, exponentials included.
      outs = [unit_fn(u, *map(part, arrays, [u] * len(arrays), arrays_hm)) for u in units]
      parts, acc_parts = [o[0] for o in outs], [o[1] for o in outs]
    else:  # units with block loops: vmapped, so one loop runs batched matmuls over them
      stacked = [jnp.stack([part(x, u, hm) for u in units]) for x, hm in zip(arrays, arrays_hm)]
      parts, acc_part = jax.vmap(unit_fn)(i * per_step + jnp.arange(per_step), *stacked)
      parts = [[p[j] for p in parts] for j in range(per_step)]
      acc_parts = [None if acc_part is None else acc_part[j] for j in range(per_step)]
    for unit, unit_parts, acc_part in zip(units, parts, acc_parts):
      results = tuple(map(put, results, unit_parts, [unit] * len(results), results_hm))
      if acc is not None:
        starts = (unit // kv_heads if acc.shape[0] > 1 else 0, unit % kv_heads if acc.shape[1] > 1 else 0, 0, 0, 0)
        acc_part = lax.dynamic_slice(acc, starts, (1, 1, *acc_part.shape)) + acc_part[None, None]
        acc = lax.dynamic_update_slice(acc, acc_part, starts)
    return results, acc

  if (batch * kv_heads) % per_step:
    raise ValueError(f"Blocking.units_per_step={per_step} must divide batch * kv_heads = {batch * kv_heads}")
  init = (tuple(jnp.zeros(r.shape, r.dtype) for r in results_like),
          None if acc_like is None else jnp.zeros(acc_like.shape, acc_like.dtype))
  return lax.fori_loop(0, batch * kv_heads // per_step, step, init)


def _forward(query, key, value, mask, bias, st: _Static):
  """query [batch, q_len_padded, heads, head_dim], key, value [batch, kv_len_padded, kv_heads, head_dim]
  -> (out like query, lse [batch, q_len_padded, heads] float32)."""
  def unit_fn(unit, q_u, k_u, v_u):
    b, k = unit // st.kv_heads, unit % st.kv_heads
    return _unit_forward(q_u, k_u[:, 0], v_u[:, 0], _unit_slice(mask, b, k), _unit_slice(bias, b, k), st), None

  lse_like = jax.ShapeDtypeStruct(query.shape[:3], jnp.float32)
  kv = (1, 2) if st.kv_heads_major else ()
  return _map_units(unit_fn, (query, key, value), (query, lse_like), st, heads_major=(kv, ()))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(query, key, value, mask, bias, st):
  return _forward(query, key, value, mask, bias, st)[0]


def _attention_fwd(query, key, value, mask, bias, st):
  out, lse = _forward(query, key, value, mask, bias, st)
  return out, (query, key, value, mask, bias, out, lse)


def _attention_bwd(st, residuals, o_grad):
  query, key, value, mask, bias, out, lse = residuals
  if st.blocking.backward_block_q is not None:  # the backward's own query blocks (see Blocking)
    st = dataclasses.replace(st, blocking=dataclasses.replace(
        st.blocking, block_q=st.blocking.backward_block_q, backward_block_q=None))
  delta = jnp.einsum("btnh,btnh->btn", o_grad.astype(jnp.float32), out.astype(jnp.float32))

  def unit_fn(unit, q_u, k_u, v_u, o_grad_u, lse_u, delta_u):
    b, k = unit // st.kv_heads, unit % st.kv_heads
    dq_u, dk_u, dv_u, dbias_u = _unit_backward(
        q_u, o_grad_u, lse_u, delta_u, k_u[:, 0], v_u[:, 0], _unit_slice(mask, b, k), _unit_slice(bias, b, k), st)
    return (dq_u, dk_u[:, None], dv_u[:, None]), dbias_u

  dbias_like = None if bias is None else jax.ShapeDtypeStruct(bias.shape, jnp.float32)
  kv = (1, 2) if st.kv_heads_major else ()
  (dq, dk, dv), dbias = _map_units(unit_fn, (query, key, value, o_grad, lse, delta), (query, key, value), st,
                                   dbias_like, heads_major=(kv, kv))
  return dq, dk, dv, None, None if bias is None else dbias.astype(bias.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


# Jitted so that eager calls compile the block loops once per shape instead of op by op.
@functools.partial(jax.jit, static_argnames=("is_causal", "blocking", "kv_heads_major", "scale", "scale_scores"))
def blocked_attention(query, key, value, *, mask, bias, is_causal: bool, blocking: Blocking,
                      kv_heads_major: bool = False, scale: float = 1.0, scale_scores: bool = False):
  """Attention over blocks; shapes as `dot_product_attention` (inputs already validated).

  Args:
    query: [batch, q_len, heads, head_dim]; the scores are scale * query . key (scale=1.0 for
      a query already multiplied by a traced scale): each block's query rows are scaled in their dtype, or
      with scale_scores the float32 scores (`attention.scale_on_scores`);
      key, value: [batch, kv_len, kv_heads, head_dim], or [batch, kv_heads, kv_len, head_dim] if
      kv_heads_major (read in that layout, no transposed copy).
    mask: None or bool [B', heads | 1, T', S'] with B' in {1, batch}, T' in {1, q_len}, S' in {1, kv_len}.
    bias: None or float, shaped like mask.
  Returns:
    [batch, q_len, heads, head_dim] in query's dtype.
  """
  b, t, n, h = query.shape
  s, kv_heads = (key.shape[2], key.shape[1]) if kv_heads_major else (key.shape[1], key.shape[2])
  groups = n // kv_heads
  bq = t if blocking.parallel_units else min(blocking.block_q, t)
  bk = min(blocking.block_k, s)
  t_pad, s_pad = math.ceil(t / bq) * bq, math.ceil(s / bk) * bk
  bq_backward = blocking.backward_block_q
  if bq_backward is None or blocking.parallel_units or not 0 < bq_backward < bq or t_pad % bq_backward:
    bq_backward = None
  blocking = dataclasses.replace(blocking, block_q=bq, block_k=bk, backward_block_q=bq_backward)
  st = _Static(blocking=blocking, is_causal=is_causal, kv_len=s, kv_heads=kv_heads,
               may_hide_rows=masks_lib.may_hide_rows(mask, bias, is_causal, t, s), kv_heads_major=kv_heads_major,
               query_offset=s - t, scale=scale, scale_scores=scale_scores)

  def five_d(x, pad_value):  # [B', N', T', S'] -> [B', K', G', T', S'], padded to the block grid
    if x is None:
      return None
    x = x.reshape(x.shape[0], kv_heads, groups, *x.shape[2:]) if x.shape[1] > 1 else x[:, :, None]
    return _pad_axis(_pad_axis(x, 3, t_pad, pad_value), 4, s_pad, pad_value)

  query = _pad_axis(query, 1, t_pad)
  kv_axis = 2 if kv_heads_major else 1
  key, value = _pad_axis(key, kv_axis, s_pad), _pad_axis(value, kv_axis, s_pad)
  out = _attention(query, key, value, five_d(mask, False), five_d(bias, 0.0), st)
  return out[:, :t] if t_pad > t else out
