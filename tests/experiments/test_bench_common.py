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
