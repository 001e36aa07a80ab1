"""Helpers shared by test modules (fixtures live in conftest.py)."""
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

import jax.numpy as jnp
from absl import flags
from flax import nnx
from ml_collections import config_flags


def load_config(*argv):
  """The config exactly as launch.py resolves it from command-line arguments."""
  flag_values = flags.FlagValues()
  argv = ["prog", *argv]
  config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def abstract_model(task):
  """The task's model as shapes only (no parameters allocated)."""
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32))


REPO = pathlib.Path(__file__).resolve().parents[1]

# A very small translator: a few steps, one eval, a checkpoint.
TINY_TRANSLATOR = {
    "total_steps": 4, "batch_size": 8, "eval_batch_size": 16, "log_every_steps": 2, "eval_every_steps": 4,
    "checkpoint.every_steps": 4, "optimizer.warmup_steps": 1, "logging.tensorboard": False,
    "model.encoder.d_model": 32, "model.encoder.num_layers": 1, "model.encoder.mlp_dim": 64,
    "model.decoder.d_model": 32, "model.decoder.num_layers": 1, "model.decoder.mlp_dim": 64,
    "model.max_length": 32, "task.num_decode_examples": 16, "task.num_attention_plots": 1,
}
# ... on two years of dates.
TINY_DATES = {**TINY_TRANSLATOR, "data.first_year": 2000, "data.last_year": 2001, "data.eval_fraction": 0.05,
              "data.vocab_size": 128}


def subprocess_env(device_count: int = 1, *, optimize: bool = False) -> dict[str, str]:
  """The environment of a launch.py subprocess: CPU, `device_count` devices, this session's compilation
  cache (inherited from conftest.py). XLA's optimization level 0 halves its CPU compile time; runs that
  a test compares share the level, and `optimize=True` keeps XLA's default for the tests that must see it."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags_ = [f"--xla_force_host_platform_device_count={device_count}"]
  if not optimize:
    flags_.append("--xla_backend_optimization_level=0")
  env["XLA_FLAGS"] = " ".join(flags_)
  return env


def launch_command(config: str, workdir, *extra, overrides: dict | None = None) -> list[str]:
  """`python launch.py --config=CONFIG --workdir=WORKDIR --config.k=v ... EXTRA`."""
  return ([sys.executable, str(REPO / "launch.py"), f"--config={config}", f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in (overrides or {}).items()] + [str(e) for e in extra])


def launch(config: str, workdir, *extra, overrides: dict | None = None, stdin: str | None = None,
           device_count: int = 1, optimize: bool = False, cwd=REPO, timeout: int = 600):
  """Runs launch.py to the end; returns the CompletedProcess (stdout / stderr as text)."""
  return subprocess.run(launch_command(config, workdir, *extra, overrides=overrides), cwd=cwd, input=stdin,
                        capture_output=True, text=True, env=subprocess_env(device_count, optimize=optimize),
                        timeout=timeout)


def metric_rows(workdir) -> list[dict]:
  """The rows of a workdir's metrics.jsonl."""
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def build_once(name: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """A directory that `build(directory)` fills once per test session, shared by pytest-xdist workers.

  The first process to ask builds it under a lock; the others wait and reuse it. A failed build is
  reported to every test that asks (the error is stored). Tests must not modify the result: copy it
  (`shutil.copytree`) before writing into it.
  """
  root = pathlib.Path(os.environ["XATTN_JAX_TEST_ARTIFACTS"])
  target, failure = root / name, root / f"{name}.failed"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if failure.exists():
        raise RuntimeError(f"building the test artefact {name!r} failed earlier: {failure.read_text()[-3000:]}")
      if not target.exists():
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root))
        try:
          build(scratch)
        except BaseException as e:
          failure.write_text(f"{type(e).__name__}: {e}")
          shutil.rmtree(scratch, ignore_errors=True)
          raise
        scratch.rename(target)
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return target
