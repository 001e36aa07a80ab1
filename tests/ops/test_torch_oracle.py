"""MultiHeadAttention against torch.nn.MultiheadAttention as an independent oracle (torch in tests only)."""
import numpy as np
import pytest
from flax import nnx

from xattn_jax.layers.attention import MultiHeadAttention
from xattn_jax.ops import masks as masks_lib

torch = pytest.importorskip("torch")

EMBED, KV_FEATURES, HEADS = 512, 1024, 8


@pytest.fixture(scope="module")
def torch_and_jax_layers():
  """A torch cross-attention layer (kdim = vdim = 1024) and ours with the same weights copied in."""
  torch.manual_seed(0)
  reference = torch.nn.MultiheadAttention(EMBED, HEADS, kdim=KV_FEATURES, vdim=KV_FEATURES, batch_first=True)
  with torch.no_grad():  # torch starts the biases at zero; random ones make the comparison cover them
    reference.in_proj_bias.normal_()
    reference.out_proj.bias.normal_()
  layer = MultiHeadAttention(HEADS, EMBED, KV_FEATURES, rngs=nnx.Rngs(0))
  numpy = lambda tensor: tensor.detach().numpy()
  biases = np.split(numpy(reference.in_proj_bias), 3)
  # torch stores weights as [out, in] and computes x W^T; our kernels are [in, out].
  for projection, weight, bias in ((layer.query, reference.q_proj_weight, biases[0]),
                                   (layer.key, reference.k_proj_weight, biases[1]),
                                   (layer.value, reference.v_proj_weight, biases[2]),
                                   (layer.out, reference.out_proj.weight, numpy(reference.out_proj.bias))):
    projection.kernel[...] = numpy(weight).T
    projection.bias[...] = bias
  return reference, layer


def _inputs():
  rng = np.random.default_rng(0)
  x_q = rng.standard_normal((2, 5, EMBED)).astype(np.float32)
  x_kv = rng.standard_normal((2, 9, KV_FEATURES)).astype(np.float32)
  padded = np.zeros((2, 9), bool)
  padded[1, -2:] = True  # torch's key_padding_mask: True = ignore this key
  return x_q, x_kv, padded


def test_cross_attention_matches_torch_multihead_attention_with_key_padding(torch_and_jax_layers):
  reference, layer = torch_and_jax_layers
  x_q, x_kv, padded = _inputs()
  expected, _ = reference(torch.from_numpy(x_q), torch.from_numpy(x_kv), torch.from_numpy(x_kv),
                          key_padding_mask=torch.from_numpy(padded), need_weights=False)
  out = nnx.jit(lambda layer, x_q, x_kv, mask: layer(x_q, x_kv, mask=mask))(
      layer, x_q, x_kv, masks_lib.padding_mask(~padded))
  np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-5, rtol=1e-5)


def test_head_averaged_weights_match_torch(torch_and_jax_layers):
  reference, layer = torch_and_jax_layers
  x_q, x_kv, padded = _inputs()
  _, expected = reference(torch.from_numpy(x_q), torch.from_numpy(x_kv), torch.from_numpy(x_kv),
                          key_padding_mask=torch.from_numpy(padded), need_weights=True, average_attn_weights=True)
  weights = nnx.jit(lambda layer, x_q, x_kv, mask: layer.attention_weights(x_q, x_kv, mask=mask))(
      layer, x_q, x_kv, masks_lib.padding_mask(~padded))  # [b, heads, q, kv]
  np.testing.assert_allclose(np.asarray(weights).mean(axis=1), expected.detach().numpy(), atol=1e-6)
