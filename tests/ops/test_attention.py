"""dot_product_attention: every implementation against a plain reference, masks, causality, validation."""
import functools
import math
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.ops.attention_reference import (KINDS, make_case, output_and_grads, random_inputs, reference_attention,
                                          reference_output_and_grads)
from tests import helpers
from xattn_jax.ops import attention, blocked_attention, masks

HAS_GPU = jax.default_backend() == "gpu"
# "chunked" runs with tiny blocks (see the fixture) so the small test shapes span several query and
# key blocks, padded last blocks and skipped causal blocks. "xla" would run the small test shapes as
# "dense"; the fixture sends them through the blocked one-pass kernel, so both kernels are tested.
IMPLEMENTATIONS = ["dense", "xla", "chunked"]
SMALL_BLOCKS = blocked_attention.Blocking(block_q=4, block_k=8)
# Schedules of several units a loop step whose units have block loops, vmapped: (implementation, block_q,
# units_per_step). Units of one block, 4 a step as separate computations, are how "xla" runs the test shapes
# (test_xla_runs_the_test_shapes_as_units_of_one_block_four_a_step), so test_attention_and_gradients_match_reference
# checks that schedule for every kind.
_VMAPPED_SCHEDULES = [("xla", 4, 2), ("chunked", 4, 4)]
# The kinds whose mask or bias a unit slices out by its (batch, kv head), and whose bias gradient it adds back: a mask
# over batch and heads, a bias over heads alone (its gradient summed over the batch), and a bias over the batch alone
# with a mask and a causal offset. Several units a step run all of them; the other kinds once each.
_UNIT_SLICED_KINDS = ["bool_mask", "bias", "bias_mask_causal"]


@pytest.fixture(autouse=True)
def small_chunked_blocks(monkeypatch):
  default = attention.choose_blocking
  monkeypatch.setattr(attention, "choose_blocking", lambda impl, t, s, backend="cpu", **kw: (
      SMALL_BLOCKS if impl == "chunked" else default(impl, t, s, backend, **kw)))
  monkeypatch.setattr(attention, "_FUSED_UP_TO_SCORES", 0)


def force_blocking(monkeypatch, blocking):
  """Every blocked call takes `blocking`: a Blocking, or a function of (implementation, kv_len)."""
  make = blocking if callable(blocking) else lambda impl, s: blocking
  monkeypatch.setattr(attention, "choose_blocking", lambda impl, t, s, backend="cpu", **_: make(impl, s))


def assert_matches_reference(implementation, query, key, value, kwargs, atol):
  ours = functools.partial(attention.dot_product_attention, implementation=implementation)
  assert_function_matches_reference(ours, query, key, value, kwargs, atol)


def assert_function_matches_reference(ours, query, key, value, kwargs, atol):
  """ours(q, k, v, bias=, mask=, is_causal=): output and gradients equal the reference's."""
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=query.shape), jnp.float32)
  out, got = output_and_grads(ours, query, key, value, kwargs, cotangent)
  expected, want = reference_output_and_grads(query, key, value, kwargs, cotangent)
  chex.assert_equal_shape([out, query])
  assert out.dtype == query.dtype
  np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=atol, rtol=atol)
  for name, g, w in zip(("query", "key", "value", "bias"), got, want):
    if w is None:
      continue
    assert bool(jnp.all(jnp.isfinite(g))), f"non-finite gradient for {name}"
    np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), atol=atol, rtol=atol,
                               err_msg=f"gradient w.r.t. {name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_attention_and_gradients_match_reference(implementation, kind):
  query, key, value, kwargs = make_case(kind, seed=KINDS.index(kind))
  assert_matches_reference(implementation, query, key, value, kwargs, atol=2e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_multi_query_attention_matches_reference(implementation):
  # The cases above use grouped queries (4 heads over 2 kv heads); here all heads share one kv head.
  query, key, value, _ = random_inputs(seed=1, heads=4, kv_heads=1)
  assert_matches_reference(implementation, query, key, value, {"is_causal": True}, atol=2e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_explicit_scale_matches_reference(implementation):
  # A number for scale is applied inside the blocked kernel, block by block (forward and dq); given
  # query / (scale * sqrt(head_dim)), the scores equal the reference's default-scaled ones.
  query, key, value, kwargs = make_case("bias_mask_causal", seed=70)
  factor = 0.37 * math.sqrt(query.shape[-1])

  def ours(q, k, v, **kw):
    return attention.dot_product_attention(q / factor, k, v, scale=0.37, implementation=implementation, **kw)

  assert_function_matches_reference(ours, query, key, value, kwargs, atol=2e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradient_with_respect_to_a_traced_scale_matches_reference(implementation):
  # A learned temperature: the scale is traced, and its gradient must flow.
  query, key, value, _ = random_inputs(seed=71)
  root_h = math.sqrt(query.shape[-1])
  cotangent = jnp.asarray(np.random.default_rng(2).normal(size=query.shape), jnp.float32)

  def loss(scale, fn):
    return jnp.sum(fn(scale) * cotangent)

  ours = lambda c: attention.dot_product_attention(query, key, value, scale=c, is_causal=True,
                                                   implementation=implementation)
  reference = lambda c: reference_attention(query * (c * root_h), key, value, is_causal=True)
  got = jax.jit(jax.value_and_grad(functools.partial(loss, fn=ours)))(jnp.float32(0.6))
  want = jax.value_and_grad(functools.partial(loss, fn=reference))(jnp.float32(0.6))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert abs(float(want[1])) > 1e-3  # the gradient is not trivially zero


@pytest.mark.parametrize("implementation, kind", [
    *((implementation, "bias_mask_causal") for implementation in
      [*IMPLEMENTATIONS, "chunked_parallel_units", "chunked_4_units_per_step"]), ("chunked", "segments")])
def test_heads_major_key_value_layout_matches_reference(implementation, kind, monkeypatch):
  # kv_layout="bksh" takes key / value as [batch, kv_heads, kv_len, head_dim] (a decode cache's
  # layout); outputs and gradients (returned in that layout) must match the default layout's. Every schedule
  # reads it with a mask, a bias (its gradient beside the keys') and a causal offset; a mask alone, without
  # causal (every key block visited), once: no code reads the layout differently by mask.
  if implementation != "chunked" and implementation.startswith("chunked"):  # other schedules read it too
    blocking = blocked_attention.Blocking(block_q=4, block_k=8, parallel_units=implementation.endswith("parallel_units"),
                                          units_per_step=4 if implementation.endswith("per_step") else 1)
    force_blocking(monkeypatch, blocking)
    implementation = "chunked"
  query, key, value, kwargs = make_case(kind, seed=11)
  to_heads_major = lambda x: x.transpose(0, 2, 1, 3)

  def heads_major(q, k, v, **kw):
    return attention.dot_product_attention(q, to_heads_major(k), to_heads_major(v), implementation=implementation,
                                           kv_layout="bksh", **kw)

  assert_function_matches_reference(heads_major, query, key, value, kwargs, atol=2e-5)


@pytest.mark.parametrize("kv_heads_major", [False, True])
def test_blocked_attention_on_cpu_makes_no_head_major_copy_forward_or_backward(kv_heads_major):
  # The units in a loop read and write [batch, length, heads, head_dim] rows in place (and a cache's
  # [batch, kv_heads, length, head_dim] keys as they are); the vmapped GPU / TPU schedule transposes, which
  # shows the check sees a head-major copy where one is made.
  b, t, s, n, k, h = 2, 48, 40, 4, 2, 16  # distinct sizes, so a shape names its axes
  kv_shape = (b, k, s, h) if kv_heads_major else (b, s, k, h)
  query, key, value = (jax.random.normal(jax.random.key(i), shape) for i, shape in
                       enumerate([(b, t, n, h), kv_shape, kv_shape]))

  def compiled(blocking):
    def loss(q, k, v):
      return blocked_attention.blocked_attention(q, k, v, mask=None, bias=None, is_causal=True, blocking=blocking,
                                                 kv_heads_major=kv_heads_major, scale=h ** -0.5).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(query, key, value).compile().as_text()

  relayouts = functools.partial(helpers.full_size_relayouts, min_elements=b * s * k * h, kept_shapes={(b, t, n, h), kv_shape})
  for blocking in (blocked_attention.Blocking(16, 40), blocked_attention.Blocking(16, 8, units_per_step=2)):
    assert relayouts(compiled(blocking)) == [], blocking
  assert relayouts(compiled(blocked_attention.Blocking(16, 8, parallel_units=True)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bfloat16_inputs_give_bfloat16_outputs_close_to_reference(implementation):
  query, key, value, kwargs = make_case("bool_mask", seed=5, dtype=jnp.bfloat16)
  assert_matches_reference(implementation, query, key, value, kwargs, atol=3e-2)



@pytest.mark.parametrize("implementation, dtype", [
    *((implementation, jnp.bfloat16) for implementation in IMPLEMENTATIONS), ("chunked", jnp.float16)])
def test_half_precision_scores_are_scaled_in_float32(implementation, dtype):
  """head_dim 24: a scale 24 ** -0.5 that the dtype cannot hold. The queries were multiplied by it in their own
  dtype, one more rounding of every score: at scores ~60, bfloat16 outputs 0.09 off the float32 attention of
  the same inputs (the output's own rounding is below 0.01). Every implementation in bfloat16, the coarser;
  float16 takes the same code (scale_on_scores holds for both), checked once."""
  query, key, value, rng = random_inputs(seed=3, t=6, s=11, h=24)
  query, key, value = (x.astype(dtype) for x in (query * 18, key, value))  # scores up to ~60
  mask = jnp.asarray(rng.random((2, 1, 6, 11)) < 0.8).at[0, :, 1].set(False)  # query 1 of batch 0 sees no key
  cotangent = jnp.asarray(rng.normal(size=query.shape), jnp.float32)
  out, grads = output_and_grads(functools.partial(attention.dot_product_attention, implementation=implementation),
                                query, key, value, {"mask": mask}, cotangent)
  upcast = [x.astype(jnp.float32) for x in (query, key, value)]
  expected, want = output_and_grads(functools.partial(attention.dot_product_attention, implementation="dense"),
                                    *upcast, {"mask": mask}, cotangent)
  atol = float(jnp.finfo(dtype).eps) * float(jnp.abs(value.astype(jnp.float32)).max())  # the output's rounding
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=atol)
  for got, wanted in zip(grads[:3], want[:3]):
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), wanted, atol=0.05 * float(jnp.abs(wanted).max()))

@settings(max_examples=3, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 13), s=st.integers(1, 19), kv_heads=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 2]), causal=st.booleans(), per_step=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2 ** 16))
def test_chunked_matches_reference_over_random_shapes(b, t, s, kv_heads, groups, causal, per_step, seed):
  query, key, value, rng = random_inputs(seed, b=b, t=t, s=s, heads=kv_heads * groups, kv_heads=kv_heads, h=4)
  mask = jnp.asarray(rng.random((b, 1, t, s)) > 0.3)
  per_step = math.gcd(per_step, b * kv_heads)  # units per loop step must divide the units
  blocking = blocked_attention.Blocking(block_q=4, block_k=8, units_per_step=per_step)
  ours = functools.partial(attention.dot_product_attention, implementation="chunked")
  with mock.patch.object(attention, "choose_blocking", lambda *_, **__: blocking):
    assert_function_matches_reference(ours, query, key, value, {"mask": mask, "is_causal": causal}, atol=2e-5)


@pytest.mark.parametrize("kind, per_step", [*((kind, 1) for kind in KINDS),
                                            *((kind, 2) for kind in _UNIT_SLICED_KINDS)])
def test_a_backward_with_its_own_smaller_query_blocks_matches_reference(kind, per_step, monkeypatch):
  # Blocking.backward_block_q: 6 queries in forward blocks of 4 rows over all keys (the second padded), the
  # backward in blocks of 2 (masks, biases and causal offsets sliced at the backward's own boundaries), with one
  # unit a step (every kind) or two (their backward blocks then run vmapped; the kinds units slice).
  monkeypatch.setattr(attention, "_runs_fused", lambda implementation, *_: implementation == "dense")
  monkeypatch.setattr(attention, "choose_blocking", lambda impl, t, s, backend="cpu", **_: blocked_attention.Blocking(
      block_q=4, block_k=s, units_per_step=per_step, backward_block_q=2))
  backward_blocks = []
  unit_backward = blocked_attention._unit_backward
  monkeypatch.setattr(blocked_attention, "_unit_backward", lambda *args: (
      backward_blocks.append(args[-1].blocking.block_q), unit_backward(*args))[1])
  query, key, value, kwargs = make_case(kind, seed=40 + KINDS.index(kind))  # the reference's shapes, compiled once
  assert_matches_reference("xla", query, key, value, kwargs, atol=2e-5)
  assert set(backward_blocks) == {2}


def test_the_backward_takes_blocks_of_256_query_rows_where_a_units_forward_block_is_large():
  """A unit's forward block of 2^20 scores or more is split into backward blocks of 256 query rows, every query
  head of its group counted (a multiple of 8 dividing the forward's, at least half that many); smaller units keep
  their blocks, run side by side. On a core of 512 KiB of L2, where these sizes were measured."""
  choose = functools.partial(attention.choose_blocking, "xla", backend="cpu", threads=2, l2_bytes=512 * 1024)
  assert choose(2048, 2048, units=16).backward_block_q == 256  # forward 1024 x 2048 scores, one unit a step
  assert choose(1024, 2048, units=16).backward_block_q == 256
  assert choose(512, 512, units=16, groups=4).backward_block_q == 64  # GQA: 4 x 512 rows x 512 keys
  assert choose(2048, 2048, units=4, groups=4).backward_block_q == 64  # 4 x 256 rows x 2048 keys
  assert choose(1797, 1797, units=6).backward_block_q is None  # forward blocks of 904 = 8 x 113 rows: no divisor
  assert choose(512, 512, units=64).backward_block_q is None  # 512 x 512 scores, 8 units a step
  assert choose(512, 512, units=1).backward_block_q is None
  assert choose(128, 4096, units=8).backward_block_q is None
  assert choose(512, 16384, units=8).backward_block_q is None  # forward blocks of 128 rows already
  for units in (1, 8):  # chunked's 256 x 512 blocks
    assert attention.choose_blocking("chunked", 8192, 8192, units=units, threads=2).backward_block_q is None


def test_a_larger_l2_cache_keeps_larger_backward_blocks(tmp_path):
  """Both the split's threshold and its rows grow with the L2: at 2 MiB (an Intel Xeon's) GQA at 512 and the
  2048 rows keep their forward blocks, faster there (experiments/bench_backward_blocks.py); an unknown L2 reads as
  the 512 KiB the rule was measured on."""
  choose = functools.partial(attention.choose_blocking, "xla", backend="cpu", threads=2, l2_bytes=2 << 20)
  assert choose(512, 512, units=16, groups=4).backward_block_q is None  # 4 x 512 x 512 = 2^20 scores
  assert choose(2048, 2048, units=16).backward_block_q is None  # 1024 x 2048
  assert attention._backward_block_q(2048, 2048, 1, 2 << 20) == 1024  # 4 x 2^20 scores: 4 x 256 rows
  assert attention._backward_block_q(2048, 2048, 1, 512 * 1024) == 256
  assert choose(512, 512, units=16, groups=4, l2_bytes=1 << 18).backward_block_q == 64  # smaller: as at 512 KiB
  for level, kind, size in (("1", "Data", "48K"), ("1", "Instruction", "64K"), ("2", "Unified", "2048K")):
    folder = tmp_path / f"index{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    for name, value in (("level", level), ("type", kind), ("size", size)):
      (folder / name).write_text(value + "\n")
  assert attention.l2_cache_bytes(str(tmp_path)) == 2 << 20
  assert attention.l2_cache_bytes(str(tmp_path / "missing")) == 512 * 1024  # unknown: the tuned size
  assert attention.l2_cache_bytes() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_one_pass_kernel_over_several_query_blocks_matches_reference(kind, monkeypatch):
  # "xla"'s blocked kernel as it runs long sequences on CPU: all keys at once, several query blocks
  # (6 queries in blocks of 4: the last one padded). Forced on other backends too ("xla" runs fused there).
  monkeypatch.setattr(attention, "_runs_fused", lambda implementation, *_: implementation == "dense")
  force_blocking(monkeypatch, lambda impl, s: blocked_attention.Blocking(block_q=4, block_k=s))
  query, key, value, kwargs = make_case(kind, seed=40 + KINDS.index(kind))
  assert_matches_reference("xla", query, key, value, kwargs, atol=2e-5)


@pytest.mark.parametrize("kind, implementation, block_q, units_per_step", [
    *((kind, *schedule) for schedule in _VMAPPED_SCHEDULES for kind in _UNIT_SLICED_KINDS),
    ("none", "xla", 4, 2), ("key_padding", "xla", 4, 2), ("segments", "chunked", 4, 4), ("causal", "chunked", 4, 4)])
def test_several_units_per_step_match_reference(kind, implementation, block_q, units_per_step, monkeypatch):
  # The CPU schedules for small blocks, several (batch, kv head) units per loop step. 2 batch x
  # 2 kv heads. Units with block loops are vmapped, so their matmuls are batched: 2 units are one
  # batch element's kv heads (the one-pass kernel over query blocks), 4 span both batch elements
  # (the online softmax; the random-shape test mixes the rest).
  force_blocking(monkeypatch, lambda impl, s: blocked_attention.Blocking(
      block_q=block_q, block_k=8 if impl == "chunked" else s, units_per_step=units_per_step))
  query, key, value, kwargs = make_case(kind, seed=60 + KINDS.index(kind))
  assert_matches_reference(implementation, query, key, value, kwargs, atol=2e-5)


def test_xla_runs_the_test_shapes_as_units_of_one_block_four_a_step():
  # Units of one block (all queries, all keys) are separate computations in the step, here all 4:
  # test_attention_and_gradients_match_reference checks that schedule for every kind through "xla".
  query, key, _, _ = make_case("bias_mask_causal", seed=0)
  (b, t, n, _), (_, s, kv_heads, _) = query.shape, key.shape
  blocking = attention.choose_blocking("xla", t, s, units=b * kv_heads, groups=n // kv_heads)
  assert (blocking.block_q, blocking.block_k, blocking.units_per_step) == (t, s, b * kv_heads) == (6, 11, 4)
  assert not blocking.parallel_units and blocking.backward_block_q is None


def test_units_per_step_must_divide_the_units():
  query, key, value, _ = random_inputs(seed=0)  # 2 batch x 2 kv heads
  blocking = blocked_attention.Blocking(block_q=4, block_k=8, units_per_step=3)
  with pytest.raises(ValueError, match=r"units_per_step=3 must divide batch \* kv_heads = 4"):
    blocked_attention.blocked_attention(query, key, value, mask=None, bias=None, is_causal=False, blocking=blocking)


@pytest.mark.usefixtures("real_dispatch")
def test_cpu_blocking_units_per_step():
  # Units of one block (no block loops): up to 8 per step whatever the threads, while the step's
  # score blocks stay within 2M scores. Units with block loops: up to one per thread. Always a
  # divisor of batch * kv_heads.
  choose = functools.partial(attention.choose_blocking, backend="cpu")
  assert choose("xla", 512, 512, units=64, threads=2).units_per_step == 8  # 8 x 512 x 512 = 2M scores
  assert choose("xla", 512, 512, units=64, threads=16).units_per_step == 8
  assert choose("xla", 300, 300, units=64, threads=2).units_per_step == 8  # 23 would fit
  assert choose("xla", 1024, 1024, units=64, threads=2).units_per_step == 2  # one block is 1M scores
  assert choose("xla", 2048, 2048, units=64, threads=2).units_per_step == 1  # 2 blocks of 2M scores
  assert choose("xla", 512, 512, units=3, threads=2).units_per_step == 3
  assert choose("xla", 512, 512, units=12, threads=8).units_per_step == 6
  assert choose("chunked", 1, 8192, units=8, threads=4).units_per_step == 4  # a decode step
  assert choose("chunked", 8192, 8192, units=8, threads=2) == blocked_attention.Blocking(256, 512, units_per_step=2)
  # GQA: a unit's blocks hold `groups` query heads' rows, so fewer rows and units fit the same 2M scores.
  assert choose("xla", 512, 512, units=16, threads=2, groups=4).units_per_step == 2  # 2 x 4 x 512 x 512
  assert choose("xla", 2048, 2048, units=4, threads=2, groups=4).block_q == 256  # 4 x 256 x 2048 = 2M


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_with_parallel_units_matches_reference(kind, monkeypatch):
  # The GPU / TPU schedule (all (batch, kv head) units vmapped, one query block), run on this backend.
  parallel = blocked_attention.Blocking(block_q=4, block_k=8, parallel_units=True)
  force_blocking(monkeypatch, parallel)
  query, key, value, kwargs = make_case(kind, seed=20 + KINDS.index(kind))
  assert_matches_reference("chunked", query, key, value, kwargs, atol=2e-5)


@pytest.mark.parametrize("kind", [*KINDS, "causal_left_padding"])
def test_cudnn_wrapper_semantics_with_xla_standing_in_for_cudnn(kind, monkeypatch):
  # What `_cudnn_attention` adds around cuDNN (masks as a bias, causal with q_len != kv_len as a
  # bottom-right mask, rows that see no key zeroed), checked on any backend: jax.nn's "xla"
  # implementation treats masks and causal as cuDNN does (top-left causal, a fully masked row gets a
  # uniform softmax) and stands in for it.
  original = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *args, implementation=None, **kw: original(*args, implementation="xla", **kw))
  if kind == "causal_left_padding":  # queries 0 and 1 of item 0 see only padding keys through causal
    query, key, value, _ = random_inputs(seed=50, t=6, s=6)
    valid = jnp.asarray([[False, False, True, True, True, True], [True] * 6])
    kwargs = {"is_causal": True, "mask": masks.padding_mask(valid)}
  else:
    query, key, value, kwargs = make_case(kind, seed=50 + KINDS.index(kind))
  wrapper = lambda q, k, v, bias=None, mask=None, is_causal=False: attention._cudnn_attention(
      q, k, v, mask, bias, q.shape[-1] ** -0.5, is_causal)
  assert_function_matches_reference(wrapper, query, key, value, kwargs, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_cudnn_wrapper_in_half_precision_leaves_a_row_hidden_by_a_minus_inf_bias_finite(dtype, monkeypatch):
  # jax.nn's cuDNN path adds a mask to the bias as -0.7 x the dtype's max, in the dtype: the stand-in does
  # that before jax.nn's "xla" implementation. Unclipped, a -inf (or the dtype's min) bias plus it is -inf,
  # and a row of -inf is NaN. Clipped at a quarter of the range, a key hidden by the bias in a row that sees
  # others gets no weight, and a row hidden by its bias alone attends to the keys its mask leaves it.
  original = jax.nn.dot_product_attention

  def cudnn_like(query, key, value, *, bias, mask, scale, is_causal, implementation):
    bias = bias + jnp.where(mask, 0, -0.7 * jnp.finfo(dtype).max).astype(dtype)
    return original(query, key, value, bias=bias, scale=scale, is_causal=is_causal, implementation="xla")

  monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_like)
  query, key, value = (jax.random.normal(jax.random.key(i), shape, dtype)  # [batch, length, heads, head_dim]
                       for i, shape in enumerate([(1, 2, 1, 8), (1, 4, 1, 8), (1, 4, 1, 8)]))
  bias = jnp.asarray([[0, -jnp.inf, 0, -jnp.inf], [-jnp.inf] * 4], dtype)[None, None]  # [1, 1, q 2, kv 4]
  mask = jnp.asarray([True, True, False, True])[None, None, None]  # key 2 masked for both rows
  out = attention._cudnn_attention(query, key, value, mask, bias, 8 ** -0.5, False)
  out = np.asarray(out.astype(jnp.float32))[0, :, 0]  # -> [q 2, head_dim 8]
  values = np.asarray(value.astype(jnp.float32))[0, :, 0]  # -> [kv 4, head_dim 8]
  assert np.isfinite(out).all(), out
  np.testing.assert_allclose(out[0], values[0], atol=1e-2)  # keys 1 and 3 hidden by the bias, 2 by the mask
  # Row 1 is a mix of keys 0, 1 and 3 (weights >= 0 summing to 1): its scores decide them, or in bfloat16,
  # whose clipped bias swamps float32 scores, it is their mean.
  seen = values[[0, 1, 3]]
  weights, *_ = np.linalg.lstsq(np.concatenate([seen.T, np.ones((1, 3))]), np.append(out[1], 1.0), rcond=None)
  np.testing.assert_allclose(weights @ seen, out[1], atol=1e-2)
  assert (weights > -1e-2).all() and abs(weights.sum() - 1) < 1e-2, weights


@pytest.mark.skipif(not HAS_GPU, reason="cuDNN needs a GPU")
@pytest.mark.parametrize("kind", [*KINDS, "causal_left_padding"])
def test_cudnn_matches_reference(kind):
  # Even lengths (cuDNN's backward with a bias or mask needs them), 8 != 12 keys, GQA (4 over 2).
  if kind == "causal_left_padding":
    query, key, value, _ = random_inputs(seed=29, t=8, s=8, h=64, dtype=jnp.bfloat16)
    valid = jnp.asarray([[False, False] + [True] * 6, [True] * 8])
    kwargs = {"is_causal": True, "mask": masks.padding_mask(valid)}
  else:
    query, key, value, kwargs = make_case(kind, seed=30 + KINDS.index(kind), t=8, s=12, h=64, dtype=jnp.bfloat16)
  assert_matches_reference("cudnn", query, key, value, kwargs, atol=5e-2)


@pytest.mark.skipif(not HAS_GPU, reason="cuDNN needs a GPU")
def test_cudnn_multi_query_two_queries_after_a_cache_match_reference():
  # Two queries after 14 cached keys (cuDNN needs even lengths, so not a one-token decode step),
  # all heads on one kv head: causal with q_len != kv_len becomes a mask for cuDNN.
  query, key, value, _ = random_inputs(seed=12, b=2, t=2, s=16, heads=4, kv_heads=1, h=64, dtype=jnp.bfloat16)
  assert_matches_reference("cudnn", query, key, value, {"is_causal": True}, atol=5e-2)


# --- causality -------------------------------------------------------------------------------------


def test_causal_weights_are_zero_above_the_diagonal_and_rows_sum_to_one():
  query, key, _, _ = random_inputs(seed=2, t=5, s=8)
  weights = attention.attention_weights(query, key, is_causal=True)
  chex.assert_shape(weights, (2, 4, 5, 8))
  above = ~masks.causal_mask(5, 8)[0, 0]
  assert bool(jnp.all(weights[:, :, above] == 0.0))
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_changing_the_last_key_and_value_changes_only_the_last_output(implementation):
  query, key, value, _ = random_inputs(seed=4, t=10, s=10)
  attend = functools.partial(attention.dot_product_attention, is_causal=True, implementation=implementation)
  before = attend(query, key, value)
  after = attend(query, key.at[:, -1].add(3.0), value.at[:, -1].add(3.0))
  np.testing.assert_array_equal(before[:, :-1], after[:, :-1])
  assert not np.allclose(before[:, -1], after[:, -1])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_causal_output_has_zero_gradient_wrt_later_inputs(implementation):
  query, key, value, _ = random_inputs(seed=6, b=1, t=9, s=9, heads=2, kv_heads=1, h=4)
  attend = functools.partial(attention.dot_product_attention, is_causal=True, implementation=implementation)
  # jacobian[i, ..., j, ...]: d output row i / d input row j
  jacobians = jax.jacrev(lambda q, k, v: attend(q, k, v)[0, :, 0, 0], argnums=(0, 1, 2))(query, key, value)
  later = np.triu(np.ones((9, 9), bool), k=1)  # j > i
  for jacobian in jacobians:
    per_pair = jnp.abs(jacobian[:, 0]).sum(axis=(-2, -1))  # [i, j]
    assert bool(jnp.all(per_pair[later] == 0.0))


# --- padding ---------------------------------------------------------------------------------------


def test_padded_keys_get_zero_weight():
  query, key, _, _ = random_inputs(seed=8)
  mask = masks.padding_mask(jnp.array([7, 3]), kv_len=11)
  weights = attention.attention_weights(query, key, mask=mask)
  assert bool(jnp.all(weights[0, :, :, 7:] == 0.0)) and bool(jnp.all(weights[1, :, :, 3:] == 0.0))
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_changing_padded_keys_and_values_changes_nothing(implementation):
  query, key, value, _ = random_inputs(seed=9)
  mask = masks.padding_mask(jnp.array([7, 3]), kv_len=11)
  attend = functools.partial(attention.dot_product_attention, mask=mask, implementation=implementation)
  noise = jnp.asarray(np.random.default_rng(0).normal(size=key.shape), key.dtype)
  padded = ~mask[:, 0, 0, :, None, None]  # [b, s, 1, 1]
  np.testing.assert_array_equal(attend(query, key, value),
                                attend(query, jnp.where(padded, noise, key), jnp.where(padded, noise, value)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_padded_query_gives_zeros_and_finite_gradients(implementation):
  query, key, value, _ = random_inputs(seed=10)
  mask = masks.padding_mask(jnp.array([5, 0]), kv_len=11)  # batch 1 sees no key at all
  attend = functools.partial(attention.dot_product_attention, mask=mask, implementation=implementation)
  out = attend(query, key, value)
  assert bool(jnp.all(out[1] == 0.0))
  grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2))(query, key, value)
  for g in grads:
    assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("masking", [{}, {"mask": masks.padding_mask(jnp.array([11, 11]), kv_len=11)},
                                     {"is_causal": True}])
def test_a_nan_key_gives_nan_outputs_with_or_without_a_mask(implementation, masking):
  """The guard that gives a query seeing no key zeros read a NaN row sum as "no key": behind a mask a NaN input
  (an id past an embedding table) came out as zeros, a plausible output, where without one it came out NaN."""
  query, key, value, _ = random_inputs(seed=11)
  out = attention.dot_product_attention(query, key.at[1, 0].set(jnp.nan), value, implementation=implementation,
                                        **masking)
  assert bool(jnp.all(jnp.isfinite(out[0]))) and bool(jnp.all(jnp.isnan(out[1])))


# --- tracing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_grad_does_not_retrace_for_the_same_shapes(implementation):
  query, key, value, _ = random_inputs(seed=13)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def grads(q, k, v):
    return jax.grad(lambda q: attention.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation=implementation).sum())(q)

  chex.clear_trace_counter()
  grads(query, key, value)
  grads(query + 1.0, key, value)


# --- dispatch --------------------------------------------------------------------------------------


@pytest.fixture
def real_dispatch(monkeypatch):
  monkeypatch.undo()  # the real thresholds and block choices, not the small-shape fixture's


def _select(**overrides):
  facts = dict(backend="gpu", dtype=jnp.bfloat16, head_dim=64, q_len=512, kv_len=512, has_mask=False,
               has_bias=False, is_causal=True)
  return attention.select_implementation(**{**facts, **overrides})


@pytest.mark.usefixtures("real_dispatch")
def test_dispatch_picks_cudnn_on_gpu_for_bf16_causal():
  assert _select() == "cudnn"


@pytest.mark.usefixtures("real_dispatch")
@pytest.mark.parametrize("overrides", [
    dict(has_mask=True), dict(has_bias=True), dict(q_len=256, kv_len=1024), dict(is_causal=False, q_len=256),
], ids=["bool_mask", "bias", "causal_q_lt_kv", "cross_attention"])
def test_dispatch_picks_cudnn_for_masks_biases_and_unequal_lengths(overrides):
  assert _select(**overrides) == "cudnn"


@pytest.mark.usefixtures("real_dispatch")
@pytest.mark.parametrize("overrides", [
    dict(backend="cpu"), dict(dtype=jnp.float32), dict(head_dim=36), dict(head_dim=256),
    dict(has_bias=True, q_len=511, kv_len=511), dict(has_mask=True, q_len=1, kv_len=70000, is_causal=False),
    dict(q_len=1, kv_len=70001), dict(q_len=256, kv_len=256),
], ids=["cpu", "float32", "head_dim_not_multiple_of_8", "head_dim_too_big", "bias_odd_length",
        "mask_odd_length", "causal_decode_step_odd_length", "short_sequences_run_fused"])
def test_dispatch_avoids_cudnn_where_it_cannot_run(overrides):
  assert _select(**overrides) in ("dense", "xla", "chunked")


@pytest.mark.usefixtures("real_dispatch")
def test_dispatch_on_cpu_takes_chunked_only_for_the_longest_keys():
  """On CPU the blocked one-pass kernel ran as fast as chunked or faster up to 16384 keys on three machines;
  chunked won from 32768 (experiments/results/*attention_benchmark*.md, "Long keys")."""
  cpu = dict(backend="cpu", dtype=jnp.float32, is_causal=False)
  assert _select(**cpu, q_len=64, kv_len=64) == "xla"
  assert _select(**cpu, q_len=512, kv_len=512) == "xla"
  assert _select(**cpu, q_len=16384, kv_len=16384) == "xla"
  assert _select(**cpu, q_len=256, kv_len=32767) == "xla"
  assert _select(**cpu, q_len=256, kv_len=32768) == "chunked"
  assert _select(**cpu, q_len=1, kv_len=65536) == "xla"  # a decode step: within the fused size
  assert _select(**cpu, q_len=2, kv_len=65536) == "chunked"


@pytest.mark.usefixtures("real_dispatch")
def test_dispatch_on_cpu_takes_chunked_for_causal_and_grouped_attention_from_2048():
  """Chunked skips the key blocks above the diagonal and ran the 2048 causal and GQA rows faster than "xla" on
  five CPUs; at 512 "xla" led or tied (experiments/results/*/attention_benchmark.md)."""
  cpu = dict(backend="cpu", dtype=jnp.float32, is_causal=False)
  assert _select(**cpu, q_len=2048, kv_len=2048) == "xla"
  assert _select(**{**cpu, "is_causal": True}, q_len=2048, kv_len=2048) == "chunked"
  assert _select(**cpu, groups=4, q_len=2048, kv_len=2048) == "chunked"
  assert _select(**{**cpu, "is_causal": True}, q_len=512, kv_len=512) == "xla"
  assert _select(**cpu, groups=4, q_len=512, kv_len=512) == "xla"
  assert _select(**{**cpu, "is_causal": True}, q_len=1024, kv_len=4096) == "xla"  # fewer than 2048 queries
  assert _select(**{**cpu, "backend": "gpu"}, groups=4, q_len=2048, kv_len=2048) == "xla"  # on CPU only


@pytest.mark.usefixtures("real_dispatch")
def test_dispatch_on_gpu_takes_chunked_by_scores_per_head_not_by_keys():
  """A short query over long keys stays fused on GPU: on an H200 it ran 2.3-3.9x faster than chunked at
  kv 4096 and 16384 (experiments/results/nvidia_h200/); self-attention from 4096 keys takes chunked."""
  gpu = dict(dtype=jnp.float32, is_causal=False)
  assert _select(**gpu, q_len=128, kv_len=4096) == "xla"
  assert _select(**gpu, q_len=512, kv_len=16384) == "xla"
  assert _select(**gpu, q_len=4095, kv_len=4096) == "xla"
  assert _select(**gpu, q_len=4096, kv_len=4096) == "chunked"
  assert _select(**gpu, q_len=1024, kv_len=16384) == "chunked"
  assert _select(**gpu, q_len=1, kv_len=1 << 20) == "xla"  # a decode step over a million keys


@pytest.mark.usefixtures("real_dispatch")
def test_dispatch_on_gpu_without_cudnn_runs_fused_then_chunked_in_parallel():
  assert _select(dtype=jnp.float32, q_len=2048, kv_len=2048) == "xla"
  assert attention._runs_fused("xla", "gpu", 2048, 2048)  # one fused program, as jax.nn's "xla"
  assert not attention._runs_fused("xla", "cpu", 2048, 2048)  # the CPU's blocked one-pass kernel
  assert _select(dtype=jnp.float32, q_len=16384, kv_len=16384) == "chunked"
  assert attention.choose_blocking("chunked", 16384, 16384, "gpu").parallel_units
  assert not attention.choose_blocking("chunked", 16384, 16384, "cpu").parallel_units


def test_explicit_cudnn_without_support_raises_the_reason():
  query, key, value, _ = random_inputs(seed=0)
  with pytest.raises(ValueError, match="cudnn"):
    attention.dot_product_attention(query, key, value, implementation="cudnn")


# --- validation ------------------------------------------------------------------------------------


def _validation_cases():
  q, k, v = jnp.zeros((2, 5, 4, 8)), jnp.zeros((2, 7, 2, 8)), jnp.zeros((2, 7, 2, 8))
  return [
      ("rank", dict(query=q[0], key=k, value=v), ["query", "[5, 4, 8]"]),
      ("head_dim", dict(query=q, key=jnp.zeros((2, 7, 2, 6)), value=v), ["key", "[2, 7, 2, 6]"]),
      ("heads_divisible", dict(query=jnp.zeros((2, 5, 3, 8)), key=k, value=v), ["heads=3", "kv_heads=2"]),
      ("value_shape", dict(query=q, key=k, value=jnp.zeros((2, 6, 2, 8))), ["value", "[2, 6, 2, 8]"]),
      ("mask_broadcast", dict(query=q, key=k, value=v, mask=jnp.ones((2, 4, 5, 6), bool)),
       ["mask", "[2, 4, 5, 6]", "[2, 4, 5, 7]"]),
      ("mask_dtype", dict(query=q, key=k, value=v, mask=jnp.ones((2, 1, 1, 7))), ["mask", "bool", "float32"]),
      ("bias_broadcast", dict(query=q, key=k, value=v, bias=jnp.ones((3, 1, 5, 7))), ["bias", "[3, 1, 5, 7]"]),
      ("implementation", dict(query=q, key=k, value=v, implementation="flash"),
       ["implementation", "'flash'", "chunked"]),
      ("kv_layout", dict(query=q, key=k, value=v, kv_layout="bhsd"), ["kv_layout", "'bhsd'", "bksh"]),
      ("heads_major_head_dim", dict(query=q, key=jnp.zeros((2, 2, 7, 6)), value=v, kv_layout="bksh"),
       ["key", "[2, kv_heads, kv_len, 8]", "[2, 2, 7, 6]"]),
      # An int query would make the scale 0 (uniform attention); bool / complex would return bool / real.
      ("int_query", dict(query=q.astype(jnp.int32), key=k, value=v), ["query", "floating point", "int32"]),
      ("bool_value", dict(query=q, key=k, value=v.astype(bool)), ["value", "floating point", "bool"]),
      ("complex_key", dict(query=q, key=k.astype(jnp.complex64), value=v), ["key", "floating point", "complex64"]),
      ("empty_batch", dict(query=q[:0], key=k[:0], value=v[:0]), ["query", "empty", "[0, 5, 4, 8]"]),
      ("empty_kv", dict(query=q, key=k[:, :0], value=v[:, :0]), ["key", "empty", "[2, 0, 2, 8]"]),
      ("scale_vector", dict(query=q, key=k, value=v, scale=jnp.ones(4)), ["scale", "scalar", "[4]"]),
      ("scale_str", dict(query=q, key=k, value=v, scale="0.5"), ["scale must be a real number", "'0.5'"]),
      ("is_causal_str", dict(query=q, key=k, value=v, is_causal="no"), ["is_causal must be True or False", "'no'"]),
      ("is_causal_mask", dict(query=q, key=k, value=v, is_causal=jnp.ones((5, 7), bool)),
       ["is_causal must be True or False"]),
  ]


@pytest.mark.parametrize("name, kwargs, needles", _validation_cases(), ids=[c[0] for c in _validation_cases()])
def test_invalid_arguments_raise_value_error_naming_argument_and_shapes(name, kwargs, needles):
  with pytest.raises(ValueError) as info:
    attention.dot_product_attention(**kwargs)
  for needle in needles:
    assert needle in str(info.value), (name, str(info.value))


def test_inputs_may_be_nested_lists_and_attention_weights_validate_like_the_op_naming_itself():
  query, key, value, _ = random_inputs(seed=0)
  np.testing.assert_allclose(attention.dot_product_attention(np.asarray(query).tolist(), key, value),
                             attention.dot_product_attention(query, key, value), rtol=1e-6)
  # The errors name attention_weights, the function called (they named dot_product_attention).
  with pytest.raises(ValueError, match="attention_weights: query must be floating point, got int32"):
    attention.attention_weights(query.astype(jnp.int32), key)
  with pytest.raises(ValueError, match="attention_weights: scale must be a scalar"):
    attention.attention_weights(query, key, scale=np.ones(2))
  with pytest.raises(ValueError, match=r"attention_weights: mask must broadcast to \[batch, heads, q_len, kv_len\]"):
    attention.attention_weights(query, key, mask=np.ones((3, 2), bool))


@pytest.mark.parametrize("function", ["dot_product_attention", "attention_weights"])
def test_a_traced_is_causal_raises_naming_it(function):
  # It picks the masking while tracing: jit over it failed in a TracerBoolConversionError naming no argument.
  query, key, value, _ = random_inputs(seed=0)
  arguments = (query, key, value) if function == "dot_product_attention" else (query, key)
  call = lambda causal: getattr(attention, function)(*arguments, is_causal=causal)
  with pytest.raises(ValueError, match=r"is_causal must be a Python bool \(static under jit\), got a traced bool"):
    jax.jit(call)(True)


@pytest.mark.parametrize("implementation", ["chunked", "xla", "dense"])
def test_memory_of_forward_and_backward_grows_linearly_in_length_but_for_dense(implementation):
  """The module docstring's promise, read from XLA's own buffer plan: 4x the length takes about 4x the temporaries
  in "chunked" and blocked "xla" (no [q, kv] score matrix is held), about 16x in "dense" (it holds them all)."""
  def temporaries(length):
    spec = jax.ShapeDtypeStruct((1, length, 2, 32), jnp.float32)
    attend = lambda q, k, v: attention.dot_product_attention(q, k, v, implementation=implementation, is_causal=True)
    programs = (jax.jit(attend), jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2))))
    return [program.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes for program in programs]
  growth = [long / short for short, long in zip(temporaries(1024), temporaries(4096))]
  if implementation == "dense":
    assert min(growth) > 8, growth
  else:
    assert max(growth) < 6, growth
