"""A pre-imported Python that forks test subprocesses: `python launch.py ...` without paying the imports.

Every launch.py subprocess of the suite spends ~2.5 CPU-seconds importing jax, flax, orbax and the package
before it parses its first flag. This server imports them once (no JAX backend is started, so forking is
safe), then for each request forks a child that runs the script (or `-c` code) as `__main__` with the
request's argv, environment, working directory and stdin / stdout / stderr. The child is a real process:
its own pid for signals, exit status and pipes; it ends as an interpreter's exit does (threads joined, atexit
handlers run, files flushed) without tearing down the preloaded modules (exit_as_the_interpreter_would). Only the
imports are shared, as the modules a fresh interpreter would have loaded from the same files.

    python -m tests.launch_server SOCKET_PATH

Protocol (one request per connection on the AF_UNIX socket): the client sends one JSON line
{"argv", "env", "cwd"} with its three pipe ends as SCM_RIGHTS; the server answers "pid N\\n" once the child
is forked and "status S CPU\\n" (the raw wait status, the child's CPU-seconds) when it ends. tests/helpers.py is the client.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import types

# What launch.py and the experiment runners import before their first line of work. Importing here is what
# the children then skip (the engine, the tasks the tests launch, matplotlib for their plots, tensorboardX and
# the torch it imports for their event files, scikit-learn for the digits data); nothing here may start a JAX
# backend, or a thread other than an OpenBLAS pool (numpy's and scipy's, which stop before a fork and restart
# after it). pyplot starts on Agg, the backend metrics.plot_losses selects.
PRELOAD = ("jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "numpy", "ml_collections",
           "ml_collections.config_flags", "absl.app", "absl.flags", "matplotlib", "matplotlib.figure",
           "matplotlib.backends.backend_agg", "matplotlib.pyplot", "tensorboardX", "xattn_jax.training.loop",
           "xattn_jax.training.checkpoints", "xattn_jax.training.dependencies", "xattn_jax.training.distributed",
           "xattn_jax.training.validation", "xattn_jax.training.trainer", "xattn_jax.tasks.template",
           "xattn_jax.tasks.algorithmic", "xattn_jax.tasks.translate.task", "xattn_jax.tasks.digits.task",
           "sklearn.datasets", "sklearn.model_selection")


def serve(path: str) -> dict:
  """Accepts requests until the client closes stdin; returns a request's fields in each forked child."""
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(64)
  print("ready", flush=True)  # the client waits for this line before connecting
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ, "accept")
  selector.register(sys.stdin, selectors.EVENT_READ, "stdin")  # EOF: the client is gone
  children: dict[int, socket.socket] = {}
  while True:
    for key, _ in selector.select(timeout=0.02):
      if key.data == "stdin":
        if not sys.stdin.buffer.read1(1):
          for child in children:
            try:
              os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
              pass
          if os.path.exists(path):
            os.unlink(path)
          sys.exit(0)
        continue
      connection, _ = listener.accept()
      message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
      request = json.loads(message.decode())
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        selector.close()
        listener.close()
        connection.close()
        for other in children.values():
          other.close()
        for target, fd in enumerate(fds):
          os.dup2(fd, target)
          os.close(fd)
        return request
      for fd in fds:
        os.close(fd)
      connection.sendall(f"pid {pid}\n".encode())
      children[pid] = connection
    while children:  # reap the children that ended and report their status
      try:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
      connection = children.pop(pid, None)
      if connection is not None:
        try:
          connection.sendall(f"status {status} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
        except OSError:
          pass
        connection.close()


def run(request: dict):
  """In the forked child: becomes `python ARGV...` in the request's directory and environment. The standard
  streams stay the objects a fresh interpreter made for pipes; only their descriptors are the request's."""
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  argv = request["argv"][1:]
  if argv[0] == "-c":
    sys.argv = ["-c", *argv[2:]]
    sys.path[0] = ""
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module
    exec(compile(argv[1], "<string>", "exec"), module.__dict__)
  else:
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def main():
  for signal_number in (signal.SIGINT, signal.SIGTERM):  # a stray signal to the server ends it cleanly
    signal.signal(signal_number, signal.SIG_DFL)
  importlib.import_module("matplotlib").use("Agg")  # before pyplot, which then starts on it
  for module in PRELOAD:
    importlib.import_module(module)
  # The preloaded objects move to a generation the collector never scans: a child then neither spends time
  # scanning them nor copies their memory pages (a scan writes to every object it visits).
  gc.collect()
  gc.freeze()
  request = serve(sys.argv[1])
  signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's Ctrl-C: KeyboardInterrupt
  try:
    run(request)
  except SystemExit as stop:
    if stop.code is not None and not isinstance(stop.code, int):
      raise  # a message to print: the interpreter's own exit
    exit_as_the_interpreter_would(stop.code or 0)
  exit_as_the_interpreter_would(0)


def exit_as_the_interpreter_would(status: int):
  """Ends the child as a fresh interpreter's exit does, up to what it cannot tell apart: wait for the threads
  that are not daemons, run the atexit handlers (orbax, tensorboardX), flush every open file and the standard
  streams; then `os._exit`, skipping the teardown of every preloaded module and object, which touches (copies)
  each of their memory pages: about 0.4 s of each launch. Anything else (an uncaught exception, a
  KeyboardInterrupt, SystemExit with a message) takes the interpreter's own exit."""
  threading._shutdown()  # what Py_FinalizeEx does first
  atexit._run_exitfuncs()
  for obj in gc.get_objects():  # the files a module still holds open, which the teardown would flush
    if isinstance(obj, io.IOBase):
      try:
        if not obj.closed and obj.writable():
          obj.flush()
      except (OSError, ValueError):
        pass
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)


if __name__ == "__main__":
  main()
