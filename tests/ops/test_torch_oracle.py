"""Attention against PyTorch as an independent oracle: the op against
`torch.nn.functional.scaled_dot_product_attention`, the layer against `torch.nn.MultiheadAttention`.

torch is a test dependency (requirements-test.txt): without it this module fails to import.
"""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.ops.attention_reference import attend_as, random_inputs
from xattn_jax.layers.attention import MultiHeadAttention
from xattn_jax.ops import attention
from xattn_jax.ops import masks as masks_lib

EMBED, KV_FEATURES, HEADS = 512, 1024, 8
# Past the fused threshold (300 x 300 scores per head) the CPU dispatcher runs "xla" as the
# blocked kernel, one query block per unit and several units per loop step.
BLOCKED_LENGTH = 300


def to_torch(x):
  """[batch, length, heads, head_dim] -> torch [batch, heads, length, head_dim]."""
  return torch.from_numpy(np.array(x)).transpose(1, 2)


def from_torch(x):
  return x.detach().transpose(1, 2).numpy()


# --- the op against scaled_dot_product_attention ---------------------------------------------------


@pytest.mark.parametrize("implementation", ["dense", "xla", "chunked"])
@pytest.mark.parametrize("causal", [False, True], ids=["bool_mask", "causal"])
def test_op_matches_torch_scaled_dot_product_attention(implementation, causal, monkeypatch):
  # "xla" and "chunked" run the blocked kernel over several blocks (attention_reference.BLOCKINGS).
  query, key, value, rng = random_inputs(seed=12, t=10, s=10, heads=4, kv_heads=4)
  mask = None if causal else jnp.asarray(rng.random((2, 4, 10, 10)) > 0.3).at[..., 0].set(True)
  out = attend_as(implementation, monkeypatch)(query, key, value, mask=mask, is_causal=causal)
  expected = torch.nn.functional.scaled_dot_product_attention(
      to_torch(query), to_torch(key), to_torch(value), is_causal=causal,
      attn_mask=None if mask is None else torch.from_numpy(np.array(mask)))
  np.testing.assert_allclose(out, from_torch(expected), atol=1e-5, rtol=1e-5)


# (implementation, q_len, kv_len): the default dispatch short (fused) and past the fused threshold
# (blocked), chunked at its real block sizes, and a decode step of 3 queries after a cache.
GQA_CASES = {
    "default_fused": (None, 10, 10),
    "default_blocked": (None, BLOCKED_LENGTH, BLOCKED_LENGTH),
    "chunked_real_blocks": ("chunked", 600, 600),
    "default_decode": (None, 3, 40),
}


@pytest.mark.parametrize("case", list(GQA_CASES))
def test_grouped_query_causal_attention_matches_torch_enable_gqa(case):
  implementation, t, s = GQA_CASES[case]
  query, key, value, _ = random_inputs(seed=13, b=1, t=t, s=s, heads=8, kv_heads=2)
  out = attention.dot_product_attention(query, key, value, is_causal=True, implementation=implementation)
  # torch's is_causal aligns the queries with the first keys; ours with the last: an explicit mask.
  causal = torch.from_numpy(np.tril(np.ones((t, s), bool), k=s - t))  # True = may attend
  expected = torch.nn.functional.scaled_dot_product_attention(
      to_torch(query), to_torch(key), to_torch(value), attn_mask=causal, enable_gqa=True)
  np.testing.assert_allclose(out, from_torch(expected), atol=1e-5, rtol=1e-5)


# --- the layer against MultiheadAttention ----------------------------------------------------------


def _random_biases(reference):
  """torch starts the biases at zero; random ones make the comparison cover them."""
  with torch.no_grad():
    reference.in_proj_bias.normal_()
    reference.out_proj.bias.normal_()


def _copy_weights(reference, layer, weights):
  """Copies torch's (query, key, value) projection weights and output projection into our layer."""
  numpy = lambda tensor: tensor.detach().numpy()
  biases = np.split(numpy(reference.in_proj_bias), 3)
  # torch stores weights as [out, in] and computes x W^T; our kernels are [in, out].
  for projection, weight, bias in ((layer.query, weights[0], biases[0]), (layer.key, weights[1], biases[1]),
                                   (layer.value, weights[2], biases[2]),
                                   (layer.out, reference.out_proj.weight, numpy(reference.out_proj.bias))):
    projection.kernel[...] = numpy(weight).T
    projection.bias[...] = bias


@pytest.fixture(scope="module")
def torch_and_jax_cross_attention():
  """A torch cross-attention layer (kdim = vdim = 1024) and ours with the same weights copied in."""
  torch.manual_seed(0)
  reference = torch.nn.MultiheadAttention(EMBED, HEADS, kdim=KV_FEATURES, vdim=KV_FEATURES, batch_first=True)
  _random_biases(reference)
  layer = MultiHeadAttention(HEADS, EMBED, KV_FEATURES, rngs=nnx.Rngs(0))
  _copy_weights(reference, layer, (reference.q_proj_weight, reference.k_proj_weight, reference.v_proj_weight))
  return reference, layer


@pytest.fixture(scope="module")
def torch_and_jax_self_attention():
  """A torch self-attention layer (one packed in_proj_weight) and ours with the same weights."""
  torch.manual_seed(1)
  reference = torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
  _random_biases(reference)
  layer = MultiHeadAttention(HEADS, EMBED, rngs=nnx.Rngs(0))
  _copy_weights(reference, layer, reference.in_proj_weight.chunk(3))
  return reference, layer


def _cross_inputs():
  rng = np.random.default_rng(0)
  x_q = rng.standard_normal((2, 5, EMBED)).astype(np.float32)
  x_kv = rng.standard_normal((2, 9, KV_FEATURES)).astype(np.float32)
  padded = np.zeros((2, 9), bool)
  padded[1, -2:] = True  # torch's key_padding_mask: True = ignore this key
  return x_q, x_kv, padded


def test_cross_attention_matches_torch_multihead_attention_with_key_padding(torch_and_jax_cross_attention):
  reference, layer = torch_and_jax_cross_attention
  x_q, x_kv, padded = _cross_inputs()
  expected, _ = reference(torch.from_numpy(x_q), torch.from_numpy(x_kv), torch.from_numpy(x_kv),
                          key_padding_mask=torch.from_numpy(padded), need_weights=False)
  out = nnx.jit(lambda layer, x_q, x_kv, mask: layer(x_q, x_kv, mask=mask))(
      layer, x_q, x_kv, masks_lib.padding_mask(~padded))
  np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-5, rtol=1e-5)


def test_head_averaged_weights_match_torch(torch_and_jax_cross_attention):
  reference, layer = torch_and_jax_cross_attention
  x_q, x_kv, padded = _cross_inputs()
  _, expected = reference(torch.from_numpy(x_q), torch.from_numpy(x_kv), torch.from_numpy(x_kv),
                          key_padding_mask=torch.from_numpy(padded), need_weights=True, average_attn_weights=True)
  weights = nnx.jit(lambda layer, x_q, x_kv, mask: layer.attention_weights(x_q, x_kv, mask=mask))(
      layer, x_q, x_kv, masks_lib.padding_mask(~padded))  # [b, heads, q, kv]
  np.testing.assert_allclose(np.asarray(weights).mean(axis=1), expected.detach().numpy(), atol=1e-6)


def _torch_causal_mask(length):
  return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)  # True = may NOT attend


@pytest.mark.parametrize("length", [7, BLOCKED_LENGTH], ids=["fused", "blocked"])
def test_causal_self_attention_matches_torch_multihead_attention(torch_and_jax_self_attention, length):
  reference, layer = torch_and_jax_self_attention
  if length == BLOCKED_LENGTH:  # the length this test claims runs the blocked kernel on CPU
    assert not attention._runs_fused("xla", "cpu", length, length)
  x = np.random.default_rng(2).standard_normal((2, length, EMBED)).astype(np.float32)
  expected, _ = reference(*[torch.from_numpy(x)] * 3, attn_mask=_torch_causal_mask(length), need_weights=False)
  out = nnx.jit(lambda layer, x: layer(x, is_causal=True))(layer, x)
  np.testing.assert_allclose(out, expected.detach().numpy(), atol=2e-5, rtol=2e-5)


def test_causal_per_head_weights_match_torch(torch_and_jax_self_attention):
  reference, layer = torch_and_jax_self_attention
  x = np.random.default_rng(3).standard_normal((2, 7, EMBED)).astype(np.float32)
  _, expected = reference(*[torch.from_numpy(x)] * 3, attn_mask=_torch_causal_mask(7), need_weights=True,
                          average_attn_weights=False)  # [b, heads, q, kv]
  weights = nnx.jit(lambda layer, x: layer.attention_weights(x, is_causal=True))(layer, x)
  np.testing.assert_allclose(weights, expected.detach().numpy(), atol=1e-6)
