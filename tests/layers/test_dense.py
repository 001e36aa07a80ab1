"""layers.Dense: nnx.Linear's function and parameters, computed as one 2D matmul over any leading axes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from xattn_jax.layers import dense


def _pair(in_features=6, out_features=5, use_bias=True):
  ours = dense.Dense(in_features, out_features, use_bias=use_bias, rngs=nnx.Rngs(0))
  theirs = nnx.Linear(in_features, out_features, use_bias=use_bias, rngs=nnx.Rngs(0))
  return ours, theirs


@pytest.mark.parametrize("leading", [(), (3,), (2, 3), (2, 1, 4)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_matches_nnx_linear_values_and_gradients(leading, use_bias):
  ours, theirs = _pair(use_bias=use_bias)
  assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(theirs))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((*leading, 6)), jnp.float32)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
  assert ours(x).shape == (*leading, 5)

  def loss(module, x):
    return jnp.sum(jnp.sin(module(x)))

  grads_ours = nnx.grad(loss, argnums=(0, 1))(ours, x)
  grads_theirs = nnx.grad(loss, argnums=(0, 1))(theirs, x)
  for a, b in zip(jax.tree.leaves(grads_ours), jax.tree.leaves(grads_theirs)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_weights_from_nnx_linear_load_unchanged():
  ours, theirs = _pair()
  theirs.kernel[...] = jnp.arange(30.0).reshape(6, 5)
  nnx.update(ours, nnx.state(theirs))
  x = jnp.ones((2, 7, 6))
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6)


def test_wrong_width_names_the_shapes():
  ours, _ = _pair()
  with pytest.raises(ValueError, match=r"inputs must be \[\.\.\., 6\], got inputs\[2, 3, 4\]"):
    ours(jnp.ones((2, 3, 4)))


def test_kernel_gradient_needs_no_transposed_copy_of_the_cotangent():
  """The reason the layer exists: on [b, t, f] inputs XLA:CPU transposed the cotangent before the
  kernel-gradient matmul. The compiled gradient of Dense has no such copy of a [b*t, out] array."""
  ours, theirs = _pair(in_features=64, out_features=256)
  x = jnp.ones((8, 32, 64))

  def compiled_text(module):
    graphdef, state = nnx.split(module)

    def loss(state, x):
      return jnp.sum(jnp.maximum(nnx.merge(graphdef, state)(x), 0.0) ** 2)

    return jax.jit(jax.grad(loss)).lower(state, x).compile().as_text()

  def big_copies(text):
    entry = text[text.index("ENTRY"):]
    return [line for line in entry.splitlines()
            if "copy" in line.split("=")[0] and ("[256,256]" in line or "[8,32,256]" in line)]

  if jax.default_backend() != "cpu":
    pytest.skip("a statement about XLA:CPU's layouts")
  assert big_copies(compiled_text(theirs)), "nnx.Linear no longer transposes: Dense may be unnecessary"
  assert not big_copies(compiled_text(ours))


def _loop_dots(modules, transpose: bool, steps: int = 3) -> tuple[list, list[str]]:
  """Runs `steps` applications of the modules in a jitted lax.fori_loop through loop_kernels -> (the final
  outputs eager, the same jitted, the compiled program's computations that run a dot of the loop body)."""
  graphdef, state = nnx.split(modules)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)), jnp.float32)

  def run(state, x, steps):
    layers_at = dense.loop_kernels(nnx.merge(graphdef, state), transpose=transpose)

    def body(_, x):
      first, second = layers_at(x)
      return jnp.tanh(second(first(x)))[:, :6]
    return jax.lax.fori_loop(0, steps, body, x)  # a traced trip count, as a search's: XLA keeps the loop

  steps = jnp.asarray(steps)
  dots = helpers.loop_body_dots(jax.jit(run).lower(state, x, steps).compile().as_text())
  return run(state, x, steps), jax.jit(run)(state, x, steps), dots


def test_loop_kernels_give_the_modules_function_with_their_kernels_read_out_in_inside_the_loop():
  """A decoding loop's matmuls read the kernels stored [out, in] (contracting their minor axis), which
  XLA would otherwise hoist back to [in, out]; transpose=False leaves the loop as it was."""
  modules = [dense.Dense(6, 24, rngs=nnx.Rngs(0)), dense.Dense(24, 10, rngs=nnx.Rngs(1))]
  eager, transposed, dots = _loop_dots(modules, transpose=True)
  _, as_trained, plain_dots = _loop_dots(modules, transpose=False)
  np.testing.assert_allclose(transposed, as_trained, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(eager, as_trained, rtol=1e-5, atol=1e-6)
  if jax.default_backend() != "cpu":
    pytest.skip("a statement about XLA:CPU's layouts")
  for shape in ("f32[24,6]", "f32[10,24]"):  # [out, in], contracted on in
    assert any(shape in block and "rhs_contracting_dims={1}" in block for block in dots), (shape, dots)
  for shape in ("f32[6,24]", "f32[24,10]"):
    assert any(shape in block and "rhs_contracting_dims={0}" in block for block in plain_dots), (shape, plain_dots)
    assert not any(shape in block for block in dots), (shape, dots)


def test_loop_kernels_refuse_what_is_not_a_module():
  with pytest.raises(ValueError, match=r"modules must be nnx.Modules, got \['Dense', 'ndarray'\]"):
    dense.loop_kernels([dense.Dense(2, 3, rngs=nnx.Rngs(0)), np.zeros((2, 3))])


def test_embed_ids_is_nan_for_negative_ids_as_for_ids_past_the_table():
  table = nnx.Embed(4, 3, rngs=nnx.Rngs(0))
  rows = dense.embed_ids(table, jnp.asarray([0, 3, -1, 4]))
  np.testing.assert_array_equal(rows[:2], table.embedding[...][jnp.asarray([0, 3])])
  assert np.isnan(rows[2:]).all()
