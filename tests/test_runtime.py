"""xattn_jax.runtime: the entry points re-execute themselves once with glibc's allocator told to
reuse freed memory, keep their arguments and interpreter options, and respect a user's own
GLIBC_TUNABLES or the opt-out variable."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from xattn_jax import runtime

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
print("start", flush=True)
from xattn_jax import runtime
runtime.reexec_with_tuned_allocator()
print("argv", sys.argv[1:])
print("optimize", sys.flags.optimize)
print("tunables", os.environ.get("GLIBC_TUNABLES"))
print("active", runtime.tuned_allocator_active())
"""

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                reason="the allocator settings are glibc's")


def run_script(tmp_path, **environment):
  script = tmp_path / "entry.py"
  script.write_text(SCRIPT.format(repo=str(REPO)))
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", runtime.OPT_OUT_VARIABLE)}
  env.update(environment)
  result = subprocess.run([sys.executable, "-O", str(script), "first", "--flag=a b"], env=env,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  return result.stdout.splitlines()


def test_reexecutes_once_with_the_settings_and_the_same_arguments(tmp_path):
  lines = run_script(tmp_path)
  assert lines.count("start") == 2  # the original process, then its re-executed self, and no more
  assert "argv ['first', '--flag=a b']" in lines
  assert "optimize 1" in lines  # interpreter options (-O) survive the re-exec
  assert f"tunables {runtime.GLIBC_TUNABLES}" in lines
  assert "active True" in lines


def test_a_users_own_tunables_win(tmp_path):
  lines = run_script(tmp_path, GLIBC_TUNABLES="glibc.malloc.arena_max=2")
  assert lines.count("start") == 1
  assert "tunables glibc.malloc.arena_max=2" in lines
  assert "active False" in lines


def test_opting_out_keeps_the_default_allocator(tmp_path):
  lines = run_script(tmp_path, **{runtime.OPT_OUT_VARIABLE: "default"})
  assert lines.count("start") == 1
  assert "tunables None" in lines
