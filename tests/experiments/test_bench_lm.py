"""The LM benchmark's torch peer (experiments/bench_lm.py) computes what the JAX LanguageModel computes."""
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "experiments"))

import bench_common  # noqa: E402
import bench_lm  # noqa: E402

SIZES = dict(bench_lm.QUICK, num_layers=2, new_tokens=6)


@pytest.fixture(scope="module")
def models():
  # One torch thread: tiny ops on a busy machine otherwise wait on OpenMP barriers.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  jax_model = bench_lm.make_jax_model(SIZES, seed=1)
  yield jax_model, bench_lm.TorchLM(SIZES).copy_from(jax_model).eval()
  torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def agreement(models):
  return bench_lm.check_agreement(*models, SIZES, np.random.default_rng(0))


def test_torch_peer_computes_the_jax_models_logits(agreement):
  assert agreement["forward_jax_vs_torch"] < 1e-5 * agreement["logit_scale"]


def test_torch_cached_steps_equal_its_uncached_forward(agreement):
  assert agreement["torch_cached_vs_forward"] < 1e-5 * agreement["logit_scale"]


def test_jax_and_torch_cached_greedy_decodes_pick_the_same_tokens(models):
  jax_model, torch_model = models
  prompt = bench_lm.random_tokens(np.random.default_rng(2), SIZES["vocab"], SIZES["batch"], SIZES["prompt"])
  jax_prefill, jax_decode = bench_lm.jax_decoders(jax_model, SIZES)
  last, cache = jax_prefill(jnp.asarray(prompt))
  jax_tokens = np.asarray(jax_decode(cache, jnp.argmax(last, axis=-1).astype(jnp.int32)))
  torch_prefill, torch_decode = bench_lm.torch_decoders(torch_model, SIZES, compiled=False)
  last, cache = torch_prefill(torch.from_numpy(prompt).long())
  torch_tokens = torch_decode(cache, last.argmax(-1)).numpy()
  assert jax_tokens.shape == (SIZES["batch"], SIZES["new_tokens"])
  np.testing.assert_array_equal(jax_tokens, torch_tokens)


def test_the_decode_work_counts_weights_once_a_step_and_the_cache_as_it_fills():
  s = dict(d_model=4, mlp_dim=8, num_layers=2, vocab=10, batch=3, prompt=5, new_tokens=2)
  once, steps = bench_lm.decode_work(s)
  layer = 4 * 4 * 4 + 2 * 4 * 8  # q, k, v, out and the MLP's two matrices
  assert once == 0 and len(steps) == 2
  for t, (flops, moved) in enumerate(steps):
    keys = 5 + t + 1  # the prompt, the tokens decoded so far and this one
    assert flops == 2 * 3 * (2 * (layer + 2 * keys * 4) + 4 * 10)
    assert moved == 4 * (2 * layer + 10 * 4 + 3 * 2 * (2 * keys * 4 + 2 * 4) + 2 * 3 * 10)
  assert bench_common.machine_limit_seconds((0, steps), 1.0, 1.0) == sum(max(f, b) for f, b in steps)
