"""The benchmarks' record of what else used the machine during a run (experiments/bench_common.py)."""
import os
import pathlib
import subprocess
import sys
import time

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "experiments"))

import bench_common  # noqa: E402

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/stat").is_file(), reason="reads Linux's /proc/stat")


def test_another_process_busy_during_the_run_is_counted_as_other_use_of_the_cores():
  contention = bench_common.HostContention()
  spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    time.sleep(2.0)
    summary = contention.summary()  # before the spinner is waited for: not this process's child time yet
  finally:
    spinner.kill()
    spinner.wait()
  assert summary["other_processes_cores"] > 0.4, summary
  assert 0.0 <= summary["steal_fraction"] <= 1.0 and summary["wall_s"] >= 2.0, summary
  assert f"other processes used {summary['other_processes_cores']:.2f} cores" in (
      bench_common.HostContention.describe(summary))


def test_own_and_children_time_is_subtracted_and_steal_is_a_share_of_all_ticks(monkeypatch):
  hz = os.sysconf("SC_CLK_TCK")
  # ticks: user nice system idle iowait irq softirq steal. Over 10 s: 15 busy core-seconds, 5 of them this
  # process's (with its children), 2 idle and 1 stolen.
  snapshots = iter([(0.0, [0] * 8, 1.0), (10.0, [12 * hz, 0, 3 * hz, 2 * hz, 0, 0, 0, 1 * hz], 6.0)])
  monkeypatch.setattr(bench_common.HostContention, "_snapshot", staticmethod(lambda: next(snapshots)))
  summary = bench_common.HostContention().summary()
  assert summary == {"other_processes_cores": 1.0, "steal_fraction": round(1 / 18, 3), "wall_s": 10.0}


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
flags\t\t: fpu sse2 {flags}

processor\t: 1
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
flags\t\t: fpu sse2 {flags}
"""


@pytest.mark.parametrize("fields, described", [
    (dict(vendor="AuthenticAMD", family=23, model=1, name="AMD EPYC", flags="avx fma avx2"),
     "AMD EPYC (AVX2; family 23 model 1)"),
    (dict(vendor="AuthenticAMD", family=25, model=17, name="AMD EPYC", flags="avx2 avx512f"),
     "AMD EPYC (AVX-512, AVX2; family 25 model 17)"),
    (dict(vendor="GenuineIntel", family=6, model=143, name="Intel(R)  Xeon(R)  Processor",
          flags="avx2 avx512f amx_tile"), "Intel(R) Xeon(R) Processor (AMX, AVX-512; family 6 model 143)"),
    (dict(vendor="GenuineIntel", family=6, model=15, name="Old", flags="ssse3"), "Old (no AVX2; family 6 model 15)"),
])
def test_the_processor_is_named_with_its_family_and_model_so_two_epyc_generations_differ(fields, described):
  # one hypervisor named a Zen 1 EPYC (70 GFLOP/s at the 2048^3 matmul) and a later one (169) both "AMD EPYC"
  assert bench_common.cpu_description(CPUINFO.format(**fields)) == described


def test_results_files_written_by_a_run_do_not_make_the_next_run_dirty(tmp_path):
  def git(*args):
    return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
  git("init", "-q")
  (tmp_path / "experiments" / "results").mkdir(parents=True)
  (tmp_path / "experiments" / "results" / "table.md").write_text("old\n")
  (tmp_path / "experiments" / "bench.py").write_text("x = 1\n")
  git("add", ".")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
  (tmp_path / "experiments" / "results" / "table.md").write_text("new\n")
  assert git(*bench_common.DIRTY_STATUS) == ""
  (tmp_path / "experiments" / "bench.py").write_text("x = 2\n")
  assert "bench.py" in git(*bench_common.DIRTY_STATUS)


@pytest.mark.parametrize("record,length,label", [
    ({"commit": "0123456789abcdef", "dirty": False}, 7, "0123456"),
    ({"commit": "0123456789abcdef", "dirty": True}, 10, "0123456789+changes"),
    ({"commit": "0123456789abcdef", "dirty": True}, None, "0123456789abcdef+changes"),
    ({"commit": "", "dirty": False}, 7, "unknown"),
])
def test_every_results_file_prints_its_commit_one_way(record, length, label):
  # the scripts printed "+dirty", "-dirty", "(local changes)" or nothing at all for a tree with local changes
  assert bench_common.commit_label(record, length) == label
