"""An attention implementation registered from outside the package, after every import, counts as a built-in
one: dot_product_attention dispatches to it, the layers and config validation read the registry when they check."""
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import algorithmic as algorithmic_config
from xattn_jax.layers import MultiHeadAttention
from xattn_jax.ops import attention, register_attention_implementation
from xattn_jax.models import lm
from xattn_jax.training import validation

CALLS = []


def recorded_dense(query, key, value, *, mask, bias, is_causal, scale):
  """A researcher's own implementation: the dense one, noting the layout of each call's keys."""
  CALLS.append((query.shape, key.shape))
  return attention.dot_product_attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
                                         implementation="dense")


@pytest.fixture
def registered():
  """Registers recorded_dense as a user's code would, and removes it afterwards."""
  CALLS.clear()
  register_attention_implementation("recorded_dense", recorded_dense)
  yield
  attention.IMPLEMENTATIONS.pop("recorded_dense")


def _inputs(seed=0, batch=2, q_len=5, kv_len=7, heads=4, kv_heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(batch, q_len, heads, head_dim)), jnp.float32),
          *(jnp.asarray(rng.normal(size=(batch, kv_len, kv_heads, head_dim)), jnp.float32) for _ in range(2)))


@pytest.mark.parametrize("kv_layout", ["bskh", "bksh"])
def test_dot_product_attention_runs_a_registered_implementation_on_the_jax_nn_layout(registered, kv_layout):
  query, key, value = _inputs()
  if kv_layout == "bksh":
    key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
  mask = jnp.arange(7)[None, None, None, :] < jnp.array([7, 4])[:, None, None, None]  # [2, 1, 1, 7]
  kwargs = dict(mask=mask, is_causal=True, scale=0.3, kv_layout=kv_layout)
  out = attention.dot_product_attention(query, key, value, implementation="recorded_dense", **kwargs)
  np.testing.assert_allclose(out, attention.dot_product_attention(query, key, value, implementation="dense",
                                                                  **kwargs), atol=1e-6)
  assert CALLS == [((2, 5, 4, 8), (2, 7, 2, 8))]


def test_a_registered_implementation_must_return_the_query_shape_and_dtype(registered):
  query, key, value = _inputs()
  register_attention_implementation("halved", lambda q, k, v, **kwargs: q[:, :, :2], replace=True)
  register_attention_implementation("widened", lambda q, k, v, **kwargs: q.astype(jnp.bfloat16), replace=True)
  try:
    with pytest.raises(ValueError, match=re.escape("implementation 'halved' must return query's float32[2, 5, 4, 8] "
                                                   "[batch, q_len, heads, head_dim], got float32[2, 5, 2, 8]")):
      attention.dot_product_attention(query, key, value, implementation="halved")
    with pytest.raises(ValueError, match="implementation 'widened' must return query's float32"):
      attention.dot_product_attention(query, key, value, implementation="widened")
  finally:
    attention.IMPLEMENTATIONS.pop("halved")
    attention.IMPLEMENTATIONS.pop("widened")


def test_a_registered_name_is_not_registered_again(registered):
  for name in ("recorded_dense", "xla"):
    with pytest.raises(ValueError, match=rf"^register_attention_implementation: '{name}' is registered already"):
      register_attention_implementation(name, recorded_dense)
  with pytest.raises(ValueError, match="'xla' is a built-in kernel, which replace=True does not override"):
    register_attention_implementation("xla", recorded_dense, replace=True)
  assert attention.IMPLEMENTATIONS["xla"] is None
  other = lambda *args, **kwargs: None  # noqa: E731
  register_attention_implementation("recorded_dense", other, replace=True)
  assert attention.IMPLEMENTATIONS["recorded_dense"] is other
  with pytest.raises(ValueError, match="name must be a non-empty str, got name=''"):
    register_attention_implementation("", recorded_dense)
  with pytest.raises(ValueError, match="fn must be callable, got str"):
    register_attention_implementation("flash", "flash")
  assert "flash" not in attention.IMPLEMENTATIONS


def test_the_attention_layer_lists_the_registered_implementations_when_it_refuses_one(registered):
  with pytest.raises(ValueError, match=re.escape("MultiHeadAttention: implementation must be None or one of "
                                                 "['dense', 'xla', 'chunked', 'cudnn', 'recorded_dense'], got "
                                                 "implementation='flash'")):
    MultiHeadAttention(num_heads=4, in_features=16, implementation="flash", rngs=nnx.Rngs(0))


def test_the_language_model_runs_a_registered_implementation(registered):
  model = lm.LanguageModel(16, d_model=8, num_heads=2, num_layers=1, mlp_dim=16, max_length=8,
                           implementation="recorded_dense", rngs=nnx.Rngs(0))
  assert model(jnp.ones((2, 5), jnp.int32)).shape == (2, 5, 16)
  assert CALLS == [((2, 5, 2, 4), (2, 5, 2, 4))]


def test_validation_takes_a_registered_implementation(registered):
  config = algorithmic_config.get_config("size=micro")
  config.model.implementation = "recorded_dense"
  validation.validate_config(config)
  config.model.implementation = "flash"
  with pytest.raises(validation.ConfigError, match=re.escape(
      "config.model.implementation='flash': allowed are '' (the op's default choice) or "
      "['dense', 'xla', 'chunked', 'cudnn', 'recorded_dense']")):
    validation.validate_config(config)
