"""Tiny digit configs run end to end through launch.py (subprocesses, a few steps each)."""
import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from xattn_jax.data import digits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--config.log_every_steps=2", "--config.eval_every_steps=4", "--config.checkpoint.every_steps=4",
         "--config.logging.tensorboard=false", "--config.logging.plot=false", "--config.eval_batch_size=180"]
PERCEIVER = ["--config=configs/perceiver_digits.py:steps=4,width=16,latents=4,blocks=1",
             "--config.data.extra_eval_grids=12x12", "--config.task.num_attention_images=1", *QUICK]

pytestmark = pytest.mark.slow


def launch(*args, workdir, stdin=None):
  done = subprocess.run([sys.executable, "launch.py", f"--workdir={workdir}", *args], cwd=ROOT, input=stdin,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def checkpoint_parameters(workdir):
  """{path: array} of the floating-point arrays (the parameters, not RNG state) of the newest checkpoint."""
  directory = os.path.join(workdir, "checkpoints")
  step = max(int(name) for name in os.listdir(directory) if name.isdigit())
  with ocp.StandardCheckpointer() as checkpointer:
    tree = checkpointer.restore(os.path.join(directory, str(step), "model"))
  flat = {}

  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, f"{prefix}{key}/")
      elif jnp.issubdtype(value.dtype, jnp.floating):
        flat[f"{prefix}{key}"] = np.asarray(value)

  walk(tree, "")
  return flat


@pytest.fixture(scope="module")
def perceiver_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("perceiver"))
  launch(*PERCEIVER, workdir=workdir)
  return workdir


@pytest.fixture(scope="module")
def qformer_workdirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("qformer")
  encoder, workdir = str(root / "vit"), str(root / "qformer")
  launch(f"--config=configs/qformer_digits.py:steps=4,queries=4,encoder={encoder}",
         "--config.model.encoder_config=configs/vit_digits.py:steps=4,width=16,blocks=1",
         "--config.model.d_model=16", "--config.model.num_blocks=2", "--config.task.num_attention_images=0",
         "--config.data.extra_eval_grids=", *QUICK, workdir=workdir)
  return encoder, workdir


def test_perceiver_config_trains_and_logs_eval_on_a_resized_grid(perceiver_workdir):
  last = metrics(perceiver_workdir)[-1]
  assert last["step"] == 4
  assert {"eval/accuracy", "eval/accuracy_12x12", "train/loss"} <= set(last)
  assert last["train/tokens_handed_on"] == 4


def test_perceiver_eval_draws_each_querys_attention(perceiver_workdir):
  assert os.path.getsize(os.path.join(perceiver_workdir, "attention_maps", "test_0.png")) > 1000


def test_infer_classifies_npy_and_png_files(perceiver_workdir, tmp_path):
  split = digits.load_digits_split()
  np.save(tmp_path / "one.npy", split.test_images[0] * 16)  # on the data set's own 0..16 scale
  np.save(tmp_path / "stack.npy", split.test_images[:3])
  matplotlib.image.imsave(tmp_path / "two.png", 1.0 - split.test_images[1], cmap="gray", vmin=0, vmax=1)
  names = [str(tmp_path / "one.npy"), str(tmp_path / "stack.npy"), str(tmp_path / "two.png"), "test:5"]
  output = launch(*PERCEIVER, "--mode=infer", workdir=perceiver_workdir, stdin="\n".join(names) + "\n")
  lines = output.strip().splitlines()
  assert [line.split("\t")[0] for line in lines] == names
  assert [len(line.split("\t")[1].split()) for line in lines] == [1, 3, 1, 1]
  assert all(0 <= int(p) <= 9 for line in lines for p in line.split("\t")[1].split())


def test_qformer_config_trains_its_missing_encoder_first(qformer_workdirs):
  encoder, workdir = qformer_workdirs
  assert metrics(encoder)[-1]["step"] == 4
  assert metrics(workdir)[-1]["train/tokens_handed_on"] == 4


def test_qformer_training_leaves_the_encoder_bit_for_bit_as_trained(qformer_workdirs):
  encoder, workdir = qformer_workdirs
  trained = checkpoint_parameters(encoder)
  inside = {k[len("encoder/"):]: v for k, v in checkpoint_parameters(workdir).items() if k.startswith("encoder/")}
  assert set(inside) == set(trained)
  for key, value in trained.items():
    np.testing.assert_array_equal(inside[key], value, err_msg=key)
