"""Every attention implementation against a plain einsum + softmax reference: the forward as eval
and decoding run it (no gradients), chunked attention at its real block sizes, and second derivatives."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.attention_reference import (KINDS, MORE_KINDS, attend_as, make_case, output_and_grads, reference_attention,
                                          reference_output_and_grads)
from xattn_jax.ops import attention

HAS_GPU = jax.default_backend() == "gpu"

gpu_only = pytest.mark.skipif(not HAS_GPU, reason="cuDNN needs a GPU")
IMPLEMENTATIONS = ["dense", "xla", "chunked", pytest.param("cudnn", marks=gpu_only)]
SCHEDULES = ["chunked_parallel_units", "chunked_2_units_per_step", "xla_4_units_per_step"]


def case_for(variant, kind, seed):
  """make_case's inputs; for cuDNN in bfloat16 with head_dim 64 and even lengths (its backward needs them)."""
  if variant != "cudnn":
    return make_case(kind, seed)
  lengths = {"causal_decode": dict(t=2, s=12), "causal_more_queries_than_keys": dict(t=12, s=8)}
  return make_case(kind, seed, **lengths.get(kind, dict(t=8, s=12)), h=64, dtype=jnp.bfloat16)


def assert_forward_matches_reference(attend, query, key, value, kwargs, atol):
  """attend's output, jitted (as inference runs it) without any differentiation, equals the float64 reference."""
  is_causal = kwargs.get("is_causal", False)
  forward = jax.jit(lambda q, k, v, bias, mask: attend(q, k, v, bias=bias, mask=mask, is_causal=is_causal))
  out = forward(query, key, value, kwargs.get("bias"), kwargs.get("mask"))
  assert out.shape == query.shape and out.dtype == query.dtype
  expected = reference_attention(query, key, value, **kwargs, xp=np)
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=atol, rtol=atol)


# --- the forward without gradients (eval, decoding, inference) -----------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", KINDS + MORE_KINDS)
def test_forward_without_gradients_matches_float64_reference(implementation, kind, monkeypatch):
  query, key, value, kwargs = case_for(implementation, kind, seed=(KINDS + MORE_KINDS).index(kind))
  atol = 5e-2 if implementation == "cudnn" else 2e-5
  assert_forward_matches_reference(attend_as(implementation, monkeypatch), query, key, value, kwargs, atol)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_of_every_blocked_schedule_matches_float64_reference(schedule, monkeypatch):
  query, key, value, kwargs = make_case("bias_mask_causal", seed=80)
  assert_forward_matches_reference(attend_as(schedule, monkeypatch), query, key, value, kwargs, atol=2e-5)


# --- chunked attention at its real block sizes ---------------------------------------------------

# (q_len, kv_len, kwargs maker): each spans several query and key blocks of the real CPU blocking.
REAL_BLOCK_CASES = {
    # No mask, no bias, kv_len a multiple of the key block: the kernel's unmasked early return.
    "no_mask_keys_fill_the_blocks": (300, 1024, lambda rng, b, t, s: {}),
    # Causal after a cache, the last key block padded: the first query block skips the last key block.
    "causal_after_a_cache": (600, 1100, lambda rng, b, t, s: {"is_causal": True}),
    # Key padding, a bias and causal with more queries than keys: the first 80 queries see nothing.
    "mask_bias_causal_more_queries": (600, 520, lambda rng, b, t, s: {
        "is_causal": True,
        "mask": jnp.asarray(np.arange(s) < np.asarray([s - 100, s])[:, None])[:, None, None],
        "bias": jnp.asarray(rng.normal(size=(b, 1, 1, s)), jnp.float32)}),
}


def real_block_case(name):
  t, s, make_kwargs = REAL_BLOCK_CASES[name]
  rng = np.random.default_rng(list(REAL_BLOCK_CASES).index(name))
  b, heads, h = 2, 2, 8  # 2 units (batch x 1 kv head), 2 query heads each
  query = jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32)
  key, value = (jnp.asarray(rng.normal(size=(b, s, 1, h)), jnp.float32) for _ in range(2))
  blocking = attention.choose_blocking("chunked", t, s, units=b)
  assert blocking.block_q < t and blocking.block_k < s, f"{name} must span several blocks of {blocking}"
  return query, key, value, make_kwargs(rng, b, t, s)


@pytest.mark.parametrize("name", list(REAL_BLOCK_CASES))
def test_chunked_at_its_real_block_sizes_matches_float64_reference(name):
  query, key, value, kwargs = real_block_case(name)
  chunked = functools.partial(attention.dot_product_attention, implementation="chunked")
  assert_forward_matches_reference(chunked, query, key, value, kwargs, atol=2e-5)


def test_chunked_gradients_at_its_real_block_sizes_match_reference():
  query, key, value, kwargs = real_block_case("mask_bias_causal_more_queries")
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=query.shape), jnp.float32)
  chunked = functools.partial(attention.dot_product_attention, implementation="chunked")
  _, got = output_and_grads(chunked, query, key, value, kwargs, cotangent)
  _, want = reference_output_and_grads(query, key, value, kwargs, cotangent)
  for name, g, w in zip(("query", "key", "value", "bias"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"gradient w.r.t. {name}")


# --- second derivatives ----------------------------------------------------------------------------


def hessian_vector_product(attend, inputs, mask, cotangent, tangents, is_causal):
  """d/dx <d/dx <attend(x), cotangent>, tangents> at x = inputs = (query, key, value, bias): grad of grad."""
  def loss(inputs):
    q, k, v, bias = inputs
    return jnp.sum(attend(q, k, v, bias=bias, mask=mask, is_causal=is_causal).astype(jnp.float32) * cotangent)

  def directional_derivative(inputs):
    return sum(jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(jax.grad(loss)(inputs)), jax.tree.leaves(tangents)))

  return jax.grad(directional_derivative)(inputs)


# Compiled once per shape; ours is compiled per call (its dispatch is monkeypatched).
reference_hessian_vector_product = jax.jit(functools.partial(hessian_vector_product, reference_attention),
                                           static_argnames="is_causal")


# "chunked" runs its causal key loops inside the loop over query blocks, whose start is traced: the
# case that needs static trip counts. "xla_one_block" is the one-pass kernel without block loops;
# "xla" and "xla_backward_blocks" loop over query blocks, the latter with backward blocks of their own
# (as CPU "xla" runs past 256 x 256 scores).
@pytest.mark.parametrize("implementation", ["dense", "xla_one_block", "xla", "xla_backward_blocks", "chunked"])
def test_grad_of_grad_matches_reference_hessian_vector_product(implementation, monkeypatch):
  # One unit (1 batch, 1 kv head) keeps the compile time of the twice-differentiated loops down.
  # Causal, a mask that hides query 0 from every key, and a bias.
  query, key, value, kwargs = make_case("bias_mask_causal", seed=90, b=1, heads=2, kv_heads=1)
  kwargs["mask"] = kwargs["mask"].at[:, :, 0].set(False)
  rng = np.random.default_rng(91)
  cotangent = jnp.asarray(rng.normal(size=query.shape), jnp.float32)
  inputs = (query, key, value, kwargs.get("bias"))
  tangents = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), inputs)
  args = (inputs, kwargs.get("mask"), cotangent, tangents)
  is_causal = kwargs.get("is_causal", False)
  ours = functools.partial(hessian_vector_product, attend_as(implementation, monkeypatch))
  got = jax.jit(ours, static_argnames="is_causal")(*args, is_causal=is_causal)
  want = reference_hessian_vector_product(*args, is_causal=is_causal)
  for name, g, w in zip(("query", "key", "value", "bias"), jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(jnp.max(jnp.abs(w))) > 0.1, f"the reference's second derivative w.r.t. {name} is trivial"
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"second derivative w.r.t. {name}")


@pytest.mark.parametrize("implementation", ["dense", "xla_backward_blocks", "chunked"])
def test_hessian_is_forward_over_reverse_and_plain_forward_mode_raises(implementation, monkeypatch):
  # The module docstring's promise: jax.hessian (jacfwd of jacrev) differentiates the hand-written
  # backward in forward mode and works; jvp of the custom_vjp forward itself raises.
  query, key, value, kwargs = make_case("bias_mask_causal", seed=92, b=1, t=3, s=4, heads=1, kv_heads=1, h=2)
  attend = attend_as(implementation, monkeypatch)

  def loss(attend, q):
    return jnp.sum(jnp.sin(attend(q, key, value, **kwargs)))

  got = jax.jit(jax.hessian(functools.partial(loss, attend)))(query)
  want = jax.jit(jax.hessian(functools.partial(loss, reference_attention)))(query)
  assert float(jnp.max(jnp.abs(want))) > 0.01, "the reference's Hessian is trivial"
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(functools.partial(loss, attend), (query,), (jnp.ones_like(query),))
