"""What the sweep runners share (experiments/sweep.py): a cell's result, kept once it is finished."""
import dataclasses
import json
import pathlib
import sys

import numpy as np
import pytest

from experiments import sweep

KEYS = ("eval/a", "eval/b")


@dataclasses.dataclass(frozen=True)
class _Cell:
  """A cell whose run is a Python one-liner that logs `rows` to metrics.jsonl, as launch.py's loop does."""
  rows: tuple = ()
  status: int = 0

  def workdir(self, root):
    return root / "cell"

  def command(self, root, quick):
    lines = "".join(json.dumps(row) + "\n" for row in self.rows)
    return [sys.executable, "-c", f"import pathlib, sys; pathlib.Path({str(self.workdir(root) / 'metrics.jsonl')!r})"
            f".write_text({lines!r}); sys.exit({self.status})"]


def _write_log(workdir, rows):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_final_metrics_are_the_last_logged_value_of_each_key(tmp_path):
  _write_log(tmp_path, [{"step": 5, "eval/a": 0.1, "eval/b": 0.2}, {"step": 10, "train/loss": 1.0},
                        {"step": 10, "eval/a": 0.7, "eval/b": 0.8}])
  assert sweep.final_metrics(tmp_path, KEYS) == {"eval/a": 0.7, "eval/b": 0.8}


def test_final_metrics_name_the_keys_the_log_lacks(tmp_path):
  _write_log(tmp_path, [{"step": 10, "eval/a": 0.7}])
  with pytest.raises(RuntimeError, match="eval/b"):
    sweep.final_metrics(tmp_path, KEYS)


def test_final_metrics_name_the_file_and_line_of_a_row_that_does_not_read(tmp_path):
  """A row cut short by a kill was a JSON traceback out of the runner's thread, not its cell's FAILED line."""
  _write_log(tmp_path, [{"step": 1, "eval/a": 0.5}])
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 2, "eval/a\n')
  with pytest.raises(RuntimeError, match=r"metrics.jsonl:2: not valid JSON"):
    sweep.final_metrics(tmp_path, KEYS)


def test_a_cell_runs_once_and_keeps_its_final_metrics_in_result_json(tmp_path):
  cell = _Cell(rows=({"step": 1, "eval/a": 0.5, "eval/b": 0.25},))
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics == {"eval/a": 0.5, "eval/b": 0.25} and message.endswith("s")
  kept = json.loads((cell.workdir(tmp_path) / "result.json").read_text())
  assert {k: kept[k] for k in KEYS} == metrics and "train_seconds" in kept and kept["commit"] == sweep.head_commit()
  (cell.workdir(tmp_path) / "metrics.jsonl").unlink()  # a second call reads result.json, runs nothing
  assert sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)[1:] == (kept, "done before")


def test_a_relative_root_names_the_same_folder_for_the_cells_run_as_for_its_results(tmp_path, monkeypatch):
  """launch.py runs in the repository: a relative --workdir trained the cells there and found no results."""
  cell = _Cell(rows=({"step": 1, "eval/a": 0.5, "eval/b": 0.25},))
  monkeypatch.chdir(tmp_path)
  assert sweep.run_cell(cell, pathlib.Path("runs"), quick=True, keys=KEYS, single_thread=True)[1] == {
      "eval/a": 0.5, "eval/b": 0.25}
  assert (tmp_path / "runs" / "cell" / "result.json").is_file()


def test_a_cell_finished_under_other_settings_is_stale_neither_reused_nor_trained_over_nor_counted(tmp_path):
  """A grid whose budget changed (another commit, another --quick) would otherwise mix old cells into its table."""
  cell = _Cell(rows=({"step": 1, "eval/a": 0.5, "eval/b": 0.25},))
  kept = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)[1]
  result_path = cell.workdir(tmp_path) / "result.json"
  assert json.loads(result_path.read_text())["settings"] == sweep.settings(cell.command(tmp_path, True))
  assert sweep.finished_result(cell, tmp_path, quick=True) == json.loads(result_path.read_text())
  other = _Cell(rows=({"step": 1, "eval/a": 0.9, "eval/b": 0.9},))  # the same workdir, other arguments
  _, metrics, message = sweep.run_cell(other, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics is None and message.startswith("STALE: ") and str(cell.workdir(tmp_path)) in message
  assert sweep.finished_result(other, tmp_path, quick=True) is None
  assert {k: json.loads(result_path.read_text())[k] for k in KEYS} == {k: kept[k] for k in KEYS}  # left as it was
  # a result.json written before settings were kept is taken as it is
  result_path.write_text(json.dumps({"eval/a": 0.5, "eval/b": 0.25, "train_seconds": 1.0}))
  assert sweep.run_cell(other, tmp_path, quick=True, keys=KEYS, single_thread=True)[2] == "done before"


@dataclasses.dataclass(frozen=True)
class _LaunchCell:
  """A cell as the runners make it: a launch.py command on a config file, with overrides."""
  overrides: tuple = ("--config.total_steps=6",)

  def workdir(self, root):
    return root / "cell"

  def command(self, root, quick):
    return [sys.executable, str(sweep.REPOSITORY / "launch.py"),
            f"--config={sweep.REPOSITORY / 'configs/algorithmic.py'}:posenc=rope,operation=copy",
            f"--workdir={self.workdir(root)}", *self.overrides]


def _finished(cell, root, result, **recorded_fields):
  """A finished cell's workdir: config.json as launch.py records it (the command's config, `recorded_fields` set
  as an older commit resolved them) and `result` as result.json."""
  config = json.loads(sweep.resolved_config(cell.command(root, True)).to_json_best_effort())
  for field, value in recorded_fields.items():
    *sections, key = field.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[key] = value
  workdir = cell.workdir(root)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(config))
  (workdir / "result.json").write_text(json.dumps(result))


def test_a_cell_whose_recorded_config_resolves_differently_now_is_stale_and_names_the_fields(tmp_path):
  """Same launch arguments, another commit's config file: its result was reused silently."""
  cell = _LaunchCell()
  result = {"eval/a": 0.5, "eval/b": 0.25, "commit": "0123456789ab",
            "settings": sweep.settings(cell.command(tmp_path, True))}
  current = sweep.resolved_config(cell.command(tmp_path, True)).model.d_model
  _finished(cell, tmp_path, result, **{"model.d_model": current * 2})
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics is None and message.startswith("STALE: ") and "at commit 0123456789ab" in message
  assert f"model.d_model={current * 2}, now {current}" in message
  assert sweep.finished_result(cell, tmp_path, quick=True) is None


def test_a_result_of_the_same_config_at_another_commit_is_reused_with_a_note_and_old_results_stay_readable(
    tmp_path, monkeypatch):
  cell = _LaunchCell()
  monkeypatch.setattr(sweep, "head_commit", lambda: "fedcba9876543210")
  result = {"eval/a": 0.5, "eval/b": 0.25, "commit": "0123456789abcdef",
            "settings": sweep.settings(cell.command(tmp_path, True))}
  _finished(cell, tmp_path, result)
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics == result and message == ("done before (trained at commit 0123456789, HEAD is fedcba9876: same "
                                           "config, maybe other code)")
  old = {"eval/a": 0.5, "eval/b": 0.25, "train_seconds": 1.0}  # before settings and the commit were kept
  (cell.workdir(tmp_path) / "result.json").write_text(json.dumps(old))
  assert sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)[1:] == (old, "done before")


def test_settings_leave_out_the_interpreter_the_repository_and_the_workdir():
  command = [sys.executable, str(sweep.REPOSITORY / "launch.py"), f"--config={sweep.REPOSITORY / 'configs/x.py'}:a=1",
             "--workdir=/somewhere/cell", "--config.seed=2"]
  assert sweep.settings(command) == ["launch.py", "--config=configs/x.py:a=1", "--config.seed=2"]


def test_a_failed_cell_writes_no_result(tmp_path):
  cell = _Cell(rows=({"step": 1, "eval/a": 0.5, "eval/b": 0.25},), status=3)
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=False)
  assert metrics is None and "exit 3" in message and not (cell.workdir(tmp_path) / "result.json").exists()


def test_a_result_written_before_a_key_joined_the_table_gains_it_from_the_log(tmp_path):
  cell = _Cell()
  _write_log(cell.workdir(tmp_path), [{"step": 9, "eval/a": 0.5, "eval/b": 0.125}])
  (cell.workdir(tmp_path) / "result.json").write_text(json.dumps({"eval/a": 0.5, "train_seconds": 3.0}))
  _, metrics, _ = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics == {"eval/a": 0.5, "eval/b": 0.125, "train_seconds": 3.0}
  assert json.loads((cell.workdir(tmp_path) / "result.json").read_text()) == metrics


def test_a_result_json_that_does_not_read_fails_its_cell_naming_file_and_line_and_is_kept(tmp_path):
  """A result.json cut short (a full disk, a kill while it was written) ended the whole runner in a traceback."""
  cell = _Cell(rows=({"step": 1, "eval/a": 0.5, "eval/b": 0.25},))
  path = cell.workdir(tmp_path) / "result.json"
  path.parent.mkdir(parents=True)
  path.write_text('{"eval/a": 0.5,\n "eval/b')
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics is None and message.startswith(f"FAILED: {path}:2: not valid JSON")
  assert path.read_text() == '{"eval/a": 0.5,\n "eval/b' and not (cell.workdir(tmp_path) / "metrics.jsonl").exists()
  assert sweep.finished_result(cell, tmp_path, quick=True) is None


def test_an_unreadable_result_of_a_cell_not_launched_now_is_named_and_a_launched_ones_left_to_run_cell(tmp_path):
  """A result.json cut short of a seed beyond --seeds (or a row --only left out) was left out of the tables without a
  word, where a launched cell's is named as FAILED by run_cell."""
  from experiments import ablate_positions
  dates = ablate_positions.EXPERIMENTS[0]
  launched, earlier = ablate_positions.Cell(dates, "rope", 0), ablate_positions.Cell(dates, "rope", 1)
  for cell, text in ((launched, "{"), (earlier, "[1, 2]")):
    cell.workdir(tmp_path).mkdir(parents=True)
    (cell.workdir(tmp_path) / "result.json").write_text(text)
  rows = ablate_positions.cells(quick=True, seeds=1, only=set())
  line = sweep.taken_from_disk([], [launched], tmp_path, lambda cell: cell.experiment.name, rows)
  assert line == (f"WARNING: a cell this run did not launch is left out of the tables: "
                  f"{earlier.workdir(tmp_path) / 'result.json'}:1: not a JSON object of metrics; delete it to train "
                  "the cell again")
  assert sweep.taken_from_disk([], [launched, earlier], tmp_path, lambda cell: cell.experiment.name, rows) == ""


def test_a_cells_result_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
  """A disk filling (or a kill) while result.json was written left it cut short: the next run of the runner failed
  the finished cell."""
  import builtins

  from xattn_jax.training import records

  class FullDisk:
    def __init__(self, path, mode):
      self.file = builtins.open(path, mode)
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      self.file.close()
    def write(self, text):
      self.file.write(text[:len(text) // 2])
      raise OSError(28, "No space left on device")

  monkeypatch.setattr(records, "open", FullDisk, raising=False)  # the module's own open, builtins' elsewhere
  cell = _Cell(rows=({"step": 1, "eval/a": 0.5, "eval/b": 0.25},))
  with pytest.raises(OSError, match="No space left"):
    sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert sorted(p.name for p in cell.workdir(tmp_path).iterdir()) == ["log.txt", "metrics.jsonl"]


def test_a_result_missing_a_key_its_log_cannot_give_fails_its_cell_and_is_kept(tmp_path):
  """A result.json older than a table's key, its metrics.jsonl deleted or without the key, ended the runner in a
  traceback."""
  cell = _Cell()
  cell.workdir(tmp_path).mkdir(parents=True)
  (cell.workdir(tmp_path) / "result.json").write_text(json.dumps({"eval/a": 0.5}))
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics is None and message.startswith("FAILED: ") and "metrics.jsonl" in message
  _write_log(cell.workdir(tmp_path), [{"step": 9, "eval/a": 0.5}])
  _, metrics, message = sweep.run_cell(cell, tmp_path, quick=True, keys=KEYS, single_thread=True)
  assert metrics is None and "metrics.jsonl has no ['eval/b']" in message
  assert json.loads((cell.workdir(tmp_path) / "result.json").read_text()) == {"eval/a": 0.5}


def test_mean_std_is_the_mean_and_sample_std_of_the_keys_every_run_has():
  runs = [{"eval/a": v, "eval/b": 1.0} for v in (0.2, 0.4, 0.9)] + [{"eval/a": 0.5}]
  summary = sweep.mean_std(runs, KEYS)
  assert set(summary) == {"eval/a"} and summary["eval/a"]["seeds"] == 4
  assert summary["eval/a"]["mean"] == pytest.approx(0.5)
  assert summary["eval/a"]["std"] == pytest.approx(np.std([.2, .4, .9, .5], ddof=1))
  assert sweep.mean_std(runs[:1], KEYS)["eval/a"]["std"] == 0.0


def test_ctrl_c_starts_no_further_cell_and_exits_130(capsys):
  """The runners' pool went on starting every queued cell after Ctrl-C (a whole grid would still train)."""
  import os
  import signal
  import time
  started, reported = [], []

  def run(cell):  # as sweep.run_cell does: a cell the stop finds queued does not start
    if sweep._STOPPING.is_set():
      return cell, None, "not started"
    started.append(cell)
    time.sleep(0.2)
    return cell, {}, "done"

  def report(cell, metrics, message):
    reported.append(cell)
    if len(reported) == 1:
      os.kill(os.getpid(), signal.SIGINT)

  before = signal.getsignal(signal.SIGINT)
  with pytest.raises(SystemExit) as stopped:
    sweep.run_cells(list(range(6)), run, 1, report)
  assert stopped.value.code == 130 and len(started) <= 2
  assert "stopped; the running cells saved a checkpoint" in capsys.readouterr().err
  assert signal.getsignal(signal.SIGINT) is before and not sweep._STOPPING.is_set()


def test_a_file_as_workdir_or_results_is_refused_before_any_cell_and_a_relative_one_made_absolute(tmp_path,
                                                                                                  monkeypatch):
  """Both failed only after every cell trained: a file with a traceback, a relative workdir in orbax."""
  import argparse
  (tmp_path / "notes.txt").write_text("mine\n")
  monkeypatch.chdir(tmp_path)
  parser = argparse.ArgumentParser()
  with pytest.raises(SystemExit) as refused:
    sweep.check_folders(argparse.Namespace(workdir="runs", results="notes.txt"), parser)
  assert refused.value.code == 2
  args = argparse.Namespace(workdir="runs", results=None)
  sweep.check_folders(args, parser)
  assert args.workdir == str(tmp_path / "runs") and args.results is None


def test_a_workdir_or_results_under_a_file_is_refused_before_any_cell(tmp_path, capsys):
  """`--results=notes.txt/tables` passed the check and failed in mkdir with a traceback after every cell trained."""
  import argparse
  (tmp_path / "notes.txt").write_text("mine\n")
  for flag in ("workdir", "results"):
    args = argparse.Namespace(workdir=str(tmp_path / "runs"), results=None)
    setattr(args, flag, str(tmp_path / "notes.txt" / "sub"))
    with pytest.raises(SystemExit) as refused:
      sweep.check_folders(args, argparse.ArgumentParser())
    assert refused.value.code == 2
    assert f"--{flag}={tmp_path}/notes.txt/sub: lies under the file {tmp_path}/notes.txt" in capsys.readouterr().err
  assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_an_empty_workdir_or_results_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch, capsys):
  """`--results=$OUT` with OUT unset wrote the tables into the folder the runner was started in."""
  import argparse
  monkeypatch.chdir(tmp_path)
  for flag in ("workdir", "results"):
    args = argparse.Namespace(workdir="runs", results=None)
    setattr(args, flag, "")
    with pytest.raises(SystemExit) as refused:
      sweep.check_folders(args, argparse.ArgumentParser())
    assert refused.value.code == 2 and f"--{flag}='': empty; name a folder" in capsys.readouterr().err


@pytest.mark.parametrize("runner", ["ablate_positions", "length_generalization"])
@pytest.mark.parametrize("argv, said", [
    (["--jobs=10000"], "--jobs=10000: must be in [1, "), (["--jobs=0"], "--jobs=0: must be in [1, "),
    (["--seeds=1000"], "--seeds=1000: 1000 seeds; allowed are 1 to 20"),
    (["--seeds=0"], "--seeds=0: 0 seeds; allowed are 1 to")])
def test_too_many_jobs_or_seeds_are_one_line_before_any_cell(tmp_path, monkeypatch, capsys, runner, argv, said):
  """--jobs=10000 started a launch.py process for every cell at once; --seeds=1000 queued a thousand passes."""
  import importlib
  module = importlib.import_module(f"experiments.{runner}")
  monkeypatch.setattr(sweep, "run_cells", lambda *a, **k: pytest.fail("a cell was started"))
  monkeypatch.setattr(sweep.os, "cpu_count", lambda: 4)
  with pytest.raises(SystemExit) as refused:
    module.main([*argv, f"--workdir={tmp_path / 'w'}", f"--results={tmp_path / 'r'}"])
  error = capsys.readouterr().err
  assert refused.value.code == 2 and said in error and len(error.strip().splitlines()[-1]) > len(said)
  if argv[0].startswith("--jobs"):
    assert "--jobs" in error and "[1, 8]" in error


def test_jobs_up_to_twice_the_cores_and_up_to_max_seeds_are_taken(monkeypatch):
  import argparse
  monkeypatch.setattr(sweep.os, "cpu_count", lambda: 4)
  sweep.check_jobs(8, argparse.ArgumentParser())
  sweep.check_seeds(sweep.MAX_SEEDS, sweep.MAX_SEEDS, argparse.ArgumentParser())


def test_help_says_what_the_library_holds_and_running_it_names_the_runners():
  """`python experiments/sweep.py --help` printed nothing."""
  import subprocess
  script = str(sweep.REPOSITORY / "experiments" / "sweep.py")
  shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
  assert shown.returncode == 0 and "What the sweep runners share" in shown.stdout
  assert "experiments/ablate_positions.py --help" in shown.stdout
  ran = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
  assert ran.returncode == 2 and "a library the runners import, nothing to run" in ran.stderr

