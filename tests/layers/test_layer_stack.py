"""Layer stacking: scanned and unrolled stacks compute the same function."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xattn_jax.layers import layer_stack
from xattn_jax.training import loop, sharding


# --- layer stacking -----------------------------------------------------------------------------

class _Block(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                     ("embed", "mlp")), rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)

  def __call__(self, x, scale):
    return x + scale * jnp.tanh(self.linear(self.norm(x)))


@pytest.fixture(scope="module")
def stack():
  with nnx.use_eager_sharding(False):
    return layer_stack.create_stack(_Block, 4, nnx.Rngs(0))


def test_stacked_blocks_are_initialised_independently(stack):
  kernels = stack.linear.kernel[...]
  assert kernels.shape == (4, 8, 8) and not np.allclose(kernels[0], kernels[1])


def test_stacked_params_get_the_layers_logical_axis(stack):
  assert stack.linear.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scanned_and_unrolled_layers_give_the_same_outputs_and_gradients(stack, remat):
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))

  def loss(model, scan):
    return jnp.sum(layer_stack.apply_stack(model, x, 0.5, scan=scan, remat=remat) ** 2)

  scanned, scanned_grads = nnx.value_and_grad(loss)(stack, True)
  unrolled, unrolled_grads = nnx.value_and_grad(loss)(stack, False)
  np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(scanned_grads)),
                              nnx.to_pure_dict(nnx.state(unrolled_grads)), rtol=1e-4, atol=1e-6)


class _DropoutBlock(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, scale, *, deterministic=True):
    return x + scale * self.dropout(jnp.tanh(self.linear(x)), deterministic=deterministic)


def _dropout_stack():
  return layer_stack.create_stack(_DropoutBlock, 3, nnx.Rngs(params=0, dropout=1))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_and_unrolled_layers_draw_the_same_dropout_masks(remat):
  x = jnp.ones((2, 5, 8))

  @nnx.jit(static_argnums=1)
  def loss(model, scan):
    return jnp.sum(layer_stack.apply_stack(model, x, 0.5, scan=scan, remat=remat, deterministic=False) ** 2)

  stacks = {scan: _dropout_stack() for scan in (True, False)}
  for _ in range(2):  # a second call draws new masks either way: the unrolled loop wrote back no RNG counts
    scanned, scanned_grads = nnx.value_and_grad(loss)(stacks[True], True)
    unrolled, unrolled_grads = nnx.value_and_grad(loss)(stacks[False], False)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6)
    chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(scanned_grads, nnx.Param)),
                                nnx.to_pure_dict(nnx.state(unrolled_grads, nnx.Param)), rtol=1e-5, atol=1e-7)
  assert not np.allclose(loss(stacks[False], False), unrolled)  # a third call: other masks again


def test_dropout_in_scanned_layers_is_active_only_when_not_deterministic():
  x = jnp.ones((2, 5, 8))
  run = nnx.jit(lambda model, deterministic: layer_stack.apply_stack(
      model, x, 0.5, scan=True, deterministic=deterministic), static_argnums=1)
  stack = _dropout_stack()
  deterministic = run(stack, True)
  np.testing.assert_array_equal(deterministic, run(stack, True))
  assert not np.allclose(run(stack, False), deterministic)


@pytest.mark.parametrize("layers", [0, 2.0])
def test_num_layers_must_be_a_positive_int(layers):
  # 2.0 failed inside nnx.split_rngs with a TypeError about its splits.
  with pytest.raises(ValueError, match=f"create_stack: num_layers must be an int >= 1, got {layers}"):
    layer_stack.create_stack(_Block, layers, nnx.Rngs(0))


def test_unknown_remat_policy_is_rejected():
  with pytest.raises(ValueError, match="allowed are"):
    layer_stack.remat_policy("everything")


# --- sharding rules -----------------------------------------------------------------------------
