"""Helpers shared by test modules (fixtures live in conftest.py)."""
import atexit
import fcntl
import functools
import json
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from ml_collections import config_flags

from tests import xla_flags


def loop_body_dots(compiled_text: str) -> list[str]:
  """The computations of a compiled program's text that run a dot of a while loop's body (a fusion's too, whose
  header names its operands' shapes and layouts)."""
  return [block for block in compiled_text.split("\n\n")
          if any(" dot(" in line and "while/body" in line for line in block.splitlines())]


def full_size_relayouts(compiled_text: str, min_elements: int, kept_shapes) -> list[str]:
  """The transposes and copies of a compiled program (fused ones included) that write at least min_elements
  values in another shape than kept_shapes' or another layout than row-major."""
  found = []
  for dtype_shape, layout, op in re.findall(r"= (\w+\[[\d,]*\])(\{[\d,]*\})? (transpose|copy)\(", compiled_text):
    shape = tuple(int(d) for d in dtype_shape.split("[")[1][:-1].split(",") if d)
    row_major = "{" + ",".join(map(str, reversed(range(len(shape))))) + "}"
    if math.prod(shape) >= min_elements and (shape not in kept_shapes or layout not in ("", row_major)):
      found.append(f"{op} {dtype_shape}{layout}")
  return found


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

# A very small translator: a few steps, one eval, a checkpoint; no pictures (rendering them costs a launch
# more than its training: the runs that check them ask for them).
TINY_TRANSLATOR = {
    "total_steps": 4, "batch_size": 8, "eval_batch_size": 16, "log_every_steps": 2, "eval_every_steps": 4,
    "checkpoint.every_steps": 4, "optimizer.warmup_steps": 1, "logging.tensorboard": False, "logging.plot": False,
    "model.encoder.d_model": 32, "model.encoder.num_layers": 1, "model.encoder.mlp_dim": 64,
    "model.decoder.d_model": 32, "model.decoder.num_layers": 1, "model.decoder.mlp_dim": 64,
    "model.max_length": 32, "task.num_decode_examples": 16, "task.num_attention_plots": 0,
}
# ... on two years of dates.
TINY_DATES = {**TINY_TRANSLATOR, "data.first_year": 2000, "data.last_year": 2001, "data.eval_fraction": 0.05,
              "data.vocab_size": 128, "task.num_attention_plots": 1}


def subprocess_env(device_count: int = 1, *, optimize: bool = False, fusion_emitters: bool = False) -> dict[str, str]:
  """The environment of a launch.py subprocess: CPU, `device_count` devices, this session's compilation
  cache (inherited from conftest.py), tests/xla_flags.py's flags. Runs that a test compares share the flags;
  `optimize=True` keeps XLA's default level and emitters for the tests that must see them, and
  `fusion_emitters=True` keeps the default emitters at level 0 for runs compared bit for bit with runs of
  another program structure (several steps per call against one: the older emitters round them differently)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags_ = [f"--xla_force_host_platform_device_count={device_count}", xla_flags.ONE_CODEGEN_PIECE]
  if not optimize:
    flags_.append(xla_flags.OPTIMIZATION_LEVEL_0)
    if not fusion_emitters and xla_flags.OLDER_FUSION_EMITTERS:
      flags_.append(xla_flags.OLDER_FUSION_EMITTERS)
  env["XLA_FLAGS"] = " ".join(flags_)
  return env


def launch_command(config: str, workdir, *extra, overrides: dict | None = None) -> list[str]:
  """`python launch.py --config=CONFIG --workdir=WORKDIR --config.k=v ... EXTRA`."""
  return ([sys.executable, str(REPO / "launch.py"), f"--config={config}", f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in (overrides or {}).items()] + [str(e) for e in extra])


def launch(config: str, workdir, *extra, overrides: dict | None = None, stdin: str | None = None,
           device_count: int = 1, optimize: bool = False, cwd=REPO, timeout: int = 600):
  """Runs launch.py to the end; returns the CompletedProcess (stdout / stderr as text)."""
  return run(launch_command(config, workdir, *extra, overrides=overrides), cwd=cwd, input=stdin,
             env=subprocess_env(device_count, optimize=optimize), timeout=timeout)


# --- subprocesses forked from a pre-imported Python (tests/launch_server.py) ------------------------------
# `python SCRIPT ...` and `python -c CODE ...` children are forked from a server that has already imported
# jax, flax, orbax and the package: each skips ~2.5 CPU-seconds of imports and is otherwise a real process
# (own pid, signals, pipes, exit status). The environment variables that imports read (JAX_*, PYTHON*, ...)
# pick the server: one per distinct set, started on first use with that environment. Other commands, and
# everything when XATTN_JAX_TEST_FRESH_PROCESSES=1, run as plain subprocesses.
_IMPORT_TIME_PREFIXES = ("JAX_", "PYTHON", "TF_", "XATTN_JAX_", "COV_", "COVERAGE", "LD_", "OMP_", "MKL_",
                         "OPENBLAS_", "CUDA_", "NVIDIA_", "TPU_", "LC_", "LANG", "MPL")
_MAX_SERVERS = 3  # per test process; a request beyond them gets a plain subprocess
_servers: dict = {"owner": None, "sockets": {}}
_servers_lock = threading.Lock()  # threads of one test (a runner's parallel jobs) start one server per set
# CPU-seconds the served children of this process used so far (they are not this process's waited-for
# children, so resource.RUSAGE_CHILDREN does not count them).
served_cpu_seconds = [0.0]


def _import_time_key(env: dict[str, str]) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)))


def _server_socket(env: dict[str, str]) -> str | None:
  """The socket of this process's launch server for `env`'s import-time variables, started on first use
  (it exits when this process does); None where no more servers may start."""
  with _servers_lock:
    return _locked_server_socket(env)


def _locked_server_socket(env: dict[str, str]) -> str | None:
  if _servers["owner"] != os.getpid():  # a forked test process starts its own
    _servers.update(owner=os.getpid(), sockets={})
  key = _import_time_key(env)
  if key not in _servers["sockets"]:
    if len(_servers["sockets"]) >= _MAX_SERVERS:
      return None
    directory = tempfile.mkdtemp(prefix="xattn_jax_launch_server_")
    path = os.path.join(directory, "socket")
    server = subprocess.Popen([sys.executable, "-m", "tests.launch_server", path], cwd=REPO, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if server.stdout.readline() != b"ready\n":
      raise RuntimeError(f"the launch server did not start (status {server.wait()})")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    atexit.register(server.stdin.close)
    _servers["sockets"][key] = path
  return _servers["sockets"][key]


def _served(argv: list[str], env: dict[str, str]) -> str | None:
  """The server socket that runs `argv` in `env`, or None for a plain subprocess."""
  if (os.environ.get("XATTN_JAX_TEST_FRESH_PROCESSES") == "1" or len(argv) < 2 or argv[0] != sys.executable
      or (argv[1].startswith("-") and argv[1] != "-c")):
    return None
  return _server_socket(env)


class ServedProcess:
  """A child of the launch server with the subset of subprocess.Popen's interface the tests use (text mode):
  pid, returncode, poll, wait, communicate, send_signal, kill."""

  def __init__(self, argv: list[str], *, cwd, env: dict[str, str], stdin_pipe: bool, server: str):
    self.args, self.returncode = argv, None
    child_stdin, self._stdin = os.pipe() if stdin_pipe else (os.open(os.devnull, os.O_RDONLY), None)
    self._stdout, child_stdout = os.pipe()
    self._stderr, child_stderr = os.pipe()
    self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._control.connect(server)
    request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
    socket.send_fds(self._control, [request], [child_stdin, child_stdout, child_stderr])
    for fd in (child_stdin, child_stdout, child_stderr):
      os.close(fd)
    self._replies = self._control.makefile("rb")
    self.pid = int(self._replies.readline().split()[1])
    self._status: int | None = None
    self._ended = threading.Event()
    self._outputs: dict[int, list[bytes]] = {self._stdout: [], self._stderr: []}
    self._readers = [threading.Thread(target=self._read, args=(fd,), daemon=True) for fd in self._outputs]
    for thread in [threading.Thread(target=self._await_status, daemon=True), *self._readers]:
      thread.start()

  def _await_status(self):
    reply = self._replies.readline()
    if reply.startswith(b"status "):
      _, status, cpu_seconds = reply.split()
      self._status = int(status)
      served_cpu_seconds[0] += float(cpu_seconds)
    self._control.close()
    self._ended.set()

  def _read(self, fd: int):
    while chunk := os.read(fd, 1 << 16):
      self._outputs[fd].append(chunk)
    os.close(fd)

  def poll(self) -> int | None:
    if self.returncode is None and self._ended.is_set():
      if self._status is None:
        raise RuntimeError(f"the launch server stopped before reporting how {self.args} ended")
      self.returncode = os.waitstatus_to_exitcode(self._status)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if not self._ended.wait(timeout):
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.poll()

  def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str]:
    if self._stdin is not None:
      if input:
        with open(self._stdin, "wb", closefd=False) as pipe:
          try:
            pipe.write(input.encode())
          except BrokenPipeError:
            pass
      os.close(self._stdin)
      self._stdin = None
    self.wait(timeout)
    for thread in self._readers:
      thread.join(timeout)
      if thread.is_alive():
        raise subprocess.TimeoutExpired(self.args, timeout)
    return tuple(_text(b"".join(self._outputs[fd])) for fd in (self._stdout, self._stderr))

  def send_signal(self, signal_number: int):
    if self.poll() is None:
      os.kill(self.pid, signal_number)

  def kill(self):
    self.send_signal(signal.SIGKILL)


def _text(data: bytes) -> str:
  """Output as subprocess's text mode decodes it."""
  return data.decode().replace("\r\n", "\n").replace("\r", "\n")


def start(argv: list[str], *, cwd=REPO, env: dict[str, str] | None = None, stdin_pipe: bool = False,
          fresh: bool = False):
  """Starts `argv` with stdout / stderr piped (text): subprocess.Popen's behaviour, from the launch server
  when the command is a Python script or `-c` code. `fresh`: a new interpreter, for a test about what one
  imports or how it starts."""
  env = dict(os.environ) if env is None else env
  if not fresh and (server := _served(argv, env)):
    return ServedProcess(argv, cwd=cwd, env=env, stdin_pipe=stdin_pipe, server=server)
  return subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.PIPE if stdin_pipe else None)


def run(argv: list[str], *, cwd=REPO, env: dict[str, str] | None = None, input: str | None = None,
        timeout: float | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
  """subprocess.run(argv, capture_output=True, text=True, ...), from the launch server where `start` uses it."""
  env = dict(os.environ) if env is None else env
  if fresh or not (server := _served(argv, env)):
    return subprocess.run(argv, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout,
                          stdin=None if input is not None else subprocess.DEVNULL)
  process = ServedProcess(argv, cwd=cwd, env=env, stdin_pipe=input is not None, server=server)
  try:
    stdout, stderr = process.communicate(input, timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.communicate()
    raise
  return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def served_call(argv: list[str], *, stdout, stderr=None, env: dict[str, str] | None = None, cwd=REPO) -> int:
  """subprocess.call(argv, stdout=FILE, stderr=subprocess.STDOUT, env=..., cwd=...) as `start` runs commands
  (a Python script forks from the launch server): for experiment runners whose cells are launch.py
  processes, patched in as their `subprocess.call`. Stdout, then stderr, go to FILE; returns the exit status."""
  if stderr not in (None, subprocess.STDOUT):
    raise ValueError(f"served_call: stderr must be None or subprocess.STDOUT, got {stderr!r}")
  process = start(argv, cwd=cwd, env=env)
  out, err = process.communicate()
  stdout.write(out + (err if stderr is subprocess.STDOUT else ""))
  if stderr is None:
    sys.stderr.write(err)
  return process.returncode


def subprocess_serving_calls():
  """The subprocess module with `call` replaced by served_call: patched into a runner as its `subprocess`."""
  return types.SimpleNamespace(**{**vars(subprocess), "call": served_call})


def metric_rows(workdir) -> list[dict]:
  """The rows of a workdir's metrics.jsonl."""
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def checkpoint_item(workdir, step: int, item: str = "model"):
  """The `item` ("model" or "optimizer") of a run's checkpoint at `step`, restored as stored (nested dicts)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415 - only the tests that read checkpoints need it
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(pathlib.Path(workdir).resolve() / "checkpoints" / str(step) / item)


def assert_same_arrays(a, b):
  """Equal arrays at equal paths, typed RNG keys compared through their key data (parameters, dropout RNG state,
  optimizer state)."""
  flat_a, flat_b = (dict(flatten_tree(x)) for x in (a, b))
  assert flat_a.keys() == flat_b.keys()
  for key in flat_a:
    np.testing.assert_array_equal(_key_data_or_array(flat_a[key]), _key_data_or_array(flat_b[key]), err_msg=key)


def _key_data_or_array(array):
  if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
    array = jax.random.key_data(array)
  return np.asarray(array)


def flatten_tree(tree):
  """("a/0/b", leaf) of every leaf: an int key and its string (nnx's pure dicts, orbax's restored trees) read alike."""
  return ((jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree))


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


@functools.cache
def _jitted_method(name: str, static_argnames: tuple[str, ...]):
  return nnx.jit(lambda module, *args, **kwargs: getattr(module, name)(*args, **kwargs),
                 static_argnames=static_argnames)


class Jitted:
  """`module`, with its call and methods run under `nnx.jit`: one compile per input shapes instead of one
  per primitive (a small model run eagerly compiles each of its ops for every new shape, which costs the
  suite more than the tests' arithmetic). Python-valued keyword arguments go in `static_argnames`.

      model = Jitted(Segmenter(...)); model(images, points, labels); model.encode(images)
  """

  def __init__(self, module: nnx.Module, static_argnames: tuple[str, ...] = ()):
    self.module, self._static = module, tuple(static_argnames)

  def __call__(self, *args, **kwargs):
    return _jitted_method("__call__", self._static)(self.module, *args, **kwargs)

  def __getattr__(self, name: str):
    attribute = getattr(self.module, name)
    if not callable(attribute) or isinstance(attribute, nnx.Module):
      return attribute
    return functools.partial(_jitted_method(name, self._static), self.module)

