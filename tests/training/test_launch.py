"""launch.py end to end on the toy task, in subprocesses: validation, the workdir record,
determinism, exact resume after SIGTERM / SIGKILL, the NaN guard, corrupted checkpoints, eval and
infer modes. Expensive runs are module-scoped fixtures shared between assertions. Every run trains
with dropout, so determinism and exact resume cover the dropout keys too."""
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests import helpers

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
# A tiny, fast run: checkpoints and eval at steps 4 and 8, a metrics row every step.
OVERRIDES = {
    "total_steps": STEPS, "batch_size": 8, "eval_batch_size": 8, "task.num_eval_examples": 16,
    "log_every_steps": 1, "eval_every_steps": 4, "checkpoint.every_steps": 4,
    "optimizer.warmup_steps": 2, "logging.tensorboard": False, "logging.plot": False,
    "model.dropout_rate": 0.1,
    "steps_per_call": 2,  # several steps per jitted call, and calls end mid-way between checkpoints
}
CONFIG = "configs/template.py:size=tiny"
# Compiled programs are shared between the subprocesses of a test session (same HLO, same result).


def launch_args(workdir, *extra, overrides=None):
  merged = {**OVERRIDES, **(overrides or {})}
  return ([sys.executable, str(REPO / "launch.py"), f"--config={CONFIG}", f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in merged.items()] + list(extra))


def subprocess_env(device_count=1, default_optimization=False, fusion_emitters=True):
  """The session's launch environment (tests/helpers.py), by default with XLA:CPU's default fusion emitters
  (runs here are compared bit for bit across steps per call); `default_optimization` keeps XLA's default
  level too."""
  return helpers.subprocess_env(device_count, optimize=default_optimization, fusion_emitters=fusion_emitters)


def launch(workdir, *extra, overrides=None, stdin=None, device_count=1, timeout=300, default_optimization=False,
           fresh=False, fusion_emitters=True):
  """Runs launch.py to the end, forked from the pre-imported launch server (tests/helpers.py), or with
  `fresh` as a plain subprocess: a new interpreter that imports everything itself."""
  return helpers.run(launch_args(workdir, *extra, overrides=overrides), cwd=REPO, input=stdin, timeout=timeout,
                     env=subprocess_env(device_count, default_optimization, fusion_emitters), fresh=fresh)


def start(workdir, *extra, overrides=None, device_count=1, fusion_emitters=True):
  return helpers.start(launch_args(workdir, *extra, overrides=overrides), cwd=REPO,
                       env=subprocess_env(device_count, fusion_emitters=fusion_emitters))


def metrics_rows(workdir):
  with open(Path(workdir) / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def train_losses(workdir):
  """{step: train/loss}; fails if a step was logged twice (the file must read as one run)."""
  rows = [r for r in metrics_rows(workdir) if "train/loss" in r]
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)), f"steps logged more than once: {steps}"
  return {r["step"]: r["train/loss"] for r in rows}


def checkpoint_steps(workdir):
  directory = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def wait_for(predicate, process, timeout=240):
  deadline = time.time() + timeout
  while not predicate():
    assert process.poll() is None, f"run ended early: {process.communicate()[1][-2000:]}"
    assert time.time() < deadline, "timed out waiting for the run"
    time.sleep(0.05)


# --- fail fast on an invalid config -------------------------------------------------------------

@pytest.mark.parametrize("extra,field", [
    (["--config.model.d_modle=48"], "model.d_modle"),
    # Only the override that names the field (not model.dropout_rate, which contains the name).
    (["--config.model.dropout=0.5"], "unknown config field --config.model.dropout: the config has no such field"),
    ([f"--config={CONFIG},sise=tiny"], "sise"),
    (["--config.model.d_model=30", "--config.model.num_heads=4"], "model.d_model"),
    (["--config.model.position_encoding=rope", "--config.model.rotary_dim=7"], "model.rotary_dim"),
    (["--config.model.position_encoding=mrope", "--config.model.mrope_sections=(1,2,2)"], "model.mrope_sections"),
    (["--config.model.position_encoding=fourier"], "model.position_encoding"),
    (["--config.task.name=nope"], "task.name"),
    (["--config.model.scan_layers=maybe"],
     "--config.model.scan_layers=maybe: needs true or false (t / f, 1 / 0), got 'maybe'"),
    (["--config.mesh.data=3"], "mesh"),
    (["--mode=infer", "--config.infer.input_file=/nonexistent/inputs.txt"], "infer.input_file"),
    # Multi-host flags: checked before the config (its batch check divides by --num_processes).
    (["--coordinator_address=127.0.0.1:23462", "--num_processes=0"], "--num_processes=0: must be >= 1"),
    (["--coordinator_address=127.0.0.1:23461", "--num_processes=2", "--process_id=2"], "--process_id=2"),
    (["--coordinator_address=notanaddress", "--num_processes=2"], "--coordinator_address='notanaddress'"),
    (["--coordinator_address=127.0.0.1:99999", "--num_processes=2"], "HOST:PORT"),
    (["--num_processes=2"], "needs --coordinator_address"),
])
def test_invalid_config_fails_in_one_line_naming_the_field_before_anything_runs(tmp_path, extra, field):
  workdir = tmp_path / "run"
  result = launch(workdir, *extra)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert field in lines[0] and "Traceback" not in result.stderr
  assert not workdir.exists()  # nothing was built: not even the workdir


@pytest.mark.parametrize("argv,expected", [
    ([], "--config is required; usage: python launch.py --config="),
    (["--config=configs/missing.py", "--workdir=WORKDIR"],
     "--config=configs/missing.py cannot be loaded: [Errno 2] No such file"),
    (["--config=configs/missing.py:size=tiny", "--workdir=WORKDIR"], "cannot be loaded"),
    (["--config=configs/template.py"], "--workdir is required; usage:"),
])
def test_missing_or_unloadable_config_is_a_one_line_usage_error(tmp_path, argv, expected):
  workdir = tmp_path / "run"
  argv = [arg.replace("WORKDIR", str(workdir)) for arg in argv]
  result = helpers.run([sys.executable, "launch.py", *argv], cwd=REPO, env=subprocess_env(), timeout=120)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and expected in lines[0], result.stderr
  assert not workdir.exists()


@pytest.mark.parametrize("workdir,expected", [
    ("a_file", "--workdir=PATH: is a file, not a directory"),
    ("a_file/run", "--workdir=PATH: cannot be created: TMP/a_file is a file"),
])
def test_a_workdir_that_cannot_hold_a_run_is_a_one_line_error(tmp_path, workdir, expected):
  """Swapping --workdir and a data file once ended in a FileExistsError traceback from os.makedirs."""
  (tmp_path / "a_file").write_text("my data\n")
  path = tmp_path / workdir
  result = helpers.run([sys.executable, "launch.py", "--config=configs/template.py", f"--workdir={path}"],
                       cwd=REPO, env=subprocess_env(), timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip() == "launch.py: " + expected.replace("PATH", str(path)).replace("TMP", str(tmp_path))
  assert (tmp_path / "a_file").read_text() == "my data\n"


def test_a_workdir_under_home_is_expanded(tmp_path):
  """The shell leaves `~` after `=` as it is: --workdir=~/run trained into a folder named `~`."""
  (tmp_path / "home").mkdir()
  (tmp_path / "home" / "a_file").write_text("my data\n")
  result = helpers.run([sys.executable, str(REPO / "launch.py"), f"--config={REPO / 'configs/template.py'}",
                        "--workdir=~/a_file"], cwd=tmp_path, env={**subprocess_env(), "HOME": str(tmp_path / "home")},
                       timeout=120)
  assert result.stderr.strip() == "launch.py: --workdir=~/a_file: is a file, not a directory"
  assert result.returncode == 2 and not (tmp_path / "~").exists()


def test_a_data_field_refused_in_eval_of_a_run_points_to_the_runs_own_config(tmp_path):
  """`--mode=eval --config=configs/translate_tsv.py` without the train file said only "is required", where the
  dates config's refusal named the run's config.py."""
  sys.path.insert(0, str(REPO))
  import launch as launcher
  from xattn_jax.training import validation
  error = validation.ConfigError("data.train_file", "", "is required: the path of a file")
  (tmp_path / "config.py").write_text("")
  own = tmp_path / "config.py"
  assert launcher.config_error_line(error, str(tmp_path), "eval") == (
      f"config.data.train_file='': is required: the path of a file (the run in {tmp_path} names its files in "
      f"--config={own})")
  assert launcher.config_error_line(error, str(tmp_path), "train") == str(error)  # training names its own files
  assert launcher.config_error_line(error, str(tmp_path / "new"), "infer") == str(error)  # no run there
  named = validation.ConfigError("data.train_file", "", f"... or use --config={own}")
  assert launcher.config_error_line(named, str(tmp_path), "eval") == str(named)  # said once
  # --config was the run's own already (eval at another data.sequence_length refused its data.eval_context)
  assert launcher.config_error_line(error, str(tmp_path), "eval", str(own)) == str(error)
  # a run that read no files (the digits): "names its files" pointed to a config naming none
  (tmp_path / "data_files.json").write_text("{}")
  split = validation.ConfigError("data.eval_split", "train", "allowed are ['test', 'validation']")
  assert launcher.config_error_line(split, str(tmp_path), "eval") == str(split)


def test_the_compilation_cache_defaults_to_the_users_cache_folder_unless_jax_or_the_flag_names_one(monkeypatch):
  sys.path.insert(0, str(REPO))
  import launch as launcher
  home = os.path.expanduser("~")
  assert launcher.compilation_cache(None, {}) == os.path.join(home, ".cache", "xattn_jax", "xla")
  assert launcher.compilation_cache(None, {"XDG_CACHE_HOME": "/c"}) == "/c/xattn_jax/xla"
  assert launcher.compilation_cache(None, {"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/c"}) == "/j"
  assert launcher.compilation_cache("rel", {"JAX_COMPILATION_CACHE_DIR": "/j"}) == os.path.abspath("rel")
  assert launcher.compilation_cache("", {"JAX_COMPILATION_CACHE_DIR": "/j"}) == ""
  # Off, for this process and the launch.py subprocesses it starts (this test process compiles without it already).
  monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")  # restored after the test
  launcher.use_compilation_cache("")
  assert os.environ["JAX_ENABLE_COMPILATION_CACHE"] == "false" and not jax.config.jax_enable_compilation_cache
  # A folder: this process's JAX and, through the environment, the launch.py subprocesses it starts.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))
  before = jax.config.jax_compilation_cache_dir
  try:
    launcher.use_compilation_cache("/some/cache")
    assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"] == "/some/cache"
    assert not jax.config.jax_enable_compilation_cache  # turned off (here, above) stays off: a folder does not enable it
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.slow
def test_a_second_eval_reads_every_program_from_the_compilation_cache_the_first_wrote(reference, tmp_path):
  """A second eval or infer of a run compiled everything again (the dates eval: 15.0 s, 9.1 s from the cache).
  The tests' launches keep every program they compile (no minimum compile time): the second eval writes none."""
  cache, run = tmp_path / "xla", tmp_path / "run"
  shutil.copytree(reference, run)  # eval records its result in the run
  written = []
  for _ in range(2):
    result = launch(run, "--mode=eval", f"--compilation_cache={cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    written.append({entry.name: entry.stat().st_mtime_ns for entry in cache.iterdir()})
  assert written[0] and written[1] == written[0]
  (tmp_path / "a_file").write_text("")  # a cache that cannot be made: a warning, and the eval runs
  unwritable = launch(run, "--mode=eval", f"--compilation_cache={tmp_path / 'a_file' / 'xla'}")
  assert unwritable.returncode == 0 and "persistent compilation cache" in unwritable.stderr, unwritable.stderr[-3000:]


# --- one reference run, and what it leaves in the workdir ---------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """A fresh interpreter (not the launch server): the run every other run here is compared with."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  result = launch(workdir, overrides={"logging.tensorboard": True, "logging.plot": True}, fresh=True)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


@pytest.mark.slow
def test_workdir_holds_config_metrics_tensorboard_checkpoints_and_plot(reference):
  assert json.loads((reference / "config.json").read_text())["total_steps"] == STEPS
  assert "d_model: 32" in (reference / "config.txt").read_text()
  assert (reference / "config.py").exists() and (reference / "loss.png").stat().st_size > 0
  assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
  assert checkpoint_steps(reference) == [4, 8]


@pytest.mark.slow
def test_metrics_have_a_row_per_logged_step_with_train_and_eval_values(reference):
  rows = {r["step"]: r for r in metrics_rows(reference)}
  assert sorted(rows) == list(range(1, STEPS + 1))
  for step, row in rows.items():
    assert {"train/loss", "train/learning_rate", "train/grad_norm"} <= row.keys()
    # steps/s from the first row after the first call on (that call compiles; its rate would be NaN)
    assert ("train/steps_per_second" in row) == (step > OVERRIDES["steps_per_call"])
  assert {"eval/loss", "eval/token_accuracy", "eval/exact_match"} <= rows[4].keys() & rows[8].keys()


def float_params(params):
  """{name: array} of the floating-point parameters (not the dropout RNG state)."""
  return {key: np.asarray(value) for key, value in helpers.flatten_tree(params)
          if jax.dtypes.issubdtype(value.dtype, np.floating)}


@pytest.mark.slow
def test_training_lowers_the_train_and_eval_loss(reference):
  losses = train_losses(reference)
  rows = {r["step"]: r for r in metrics_rows(reference)}
  assert losses[STEPS] < losses[1]
  assert np.mean([losses[s] for s in range(STEPS // 2 + 1, STEPS + 1)]) < \
      np.mean([losses[s] for s in range(1, STEPS // 2 + 1)])
  assert rows[STEPS]["eval/loss"] < rows[STEPS // 2]["eval/loss"]


@pytest.mark.slow
def test_training_changes_every_parameter_between_checkpoints(reference):
  """A loop that skipped the optimizer update would pass every other test here."""
  first, last = (float_params(helpers.checkpoint_item(reference, step)) for step in (4, STEPS))
  assert first.keys() == last.keys() and first
  unchanged = [key for key in first if np.array_equal(first[key], last[key])]
  assert not unchanged, unchanged


@pytest.mark.slow
def test_steps_per_call_changes_only_the_grouping_of_steps(tmp_path, reference):
  """3 steps per call (calls cut short at the step-4 eval and checkpoint): the same losses, checkpoints and
  parameters as the reference's 2 steps per call. A run of its own with the reference's seed: the test that the
  same seed gives the same losses. One step per call against a grouping of several is
  test_one_step_per_call_equals_the_default_grouping_at_the_default_optimization_level's (at XLA's default level)."""
  workdir = tmp_path / "run"
  result = launch(workdir, overrides={"steps_per_call": 3})
  assert result.returncode == 0, result.stderr[-3000:]
  assert train_losses(workdir) == train_losses(reference)
  assert checkpoint_steps(workdir) == [4, 8]
  helpers.assert_same_arrays(helpers.checkpoint_item(workdir, STEPS), helpers.checkpoint_item(reference, STEPS))


@pytest.mark.slow
def test_a_runs_config_from_before_steps_per_call_still_loads_and_resumes(tmp_path, reference):
  """config.py / config.json of a run made before the field existed: one step per call."""
  workdir = tmp_path / "old"
  shutil.copytree(reference, workdir)
  for name in ("config.py", "config.json"):
    path = workdir / name
    text = path.read_text().replace('"steps_per_call": 2, ', "").replace('"steps_per_call": 2,', "")
    assert "steps_per_call" not in text
    path.write_text(text)
  from xattn_jax.training import loop
  model, _ = loop.load_model(str(workdir))
  helpers.assert_same_arrays(nnx.to_pure_dict(nnx.state(model)), helpers.checkpoint_item(reference, STEPS))
  result = helpers.run([sys.executable, str(REPO / "launch.py"), f"--config={workdir / 'config.py'}",
                        f"--workdir={workdir}", "--mode=eval"], cwd=REPO, env=subprocess_env(1), timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_eval_mode_reports_the_latest_checkpoints_metrics(reference):
  result = launch(reference, "--mode=eval")
  assert result.returncode == 0, result.stderr[-3000:]
  evaluated = json.loads((reference / "eval_results.jsonl").read_text().splitlines()[-1])
  logged = {r["step"]: r for r in metrics_rows(reference)}[STEPS]
  assert evaluated["step"] == STEPS
  np.testing.assert_allclose(evaluated["eval/loss"], logged["eval/loss"], rtol=1e-6)
  # This eval's logging flags differ from the run's: only training reads them, so its row does not list them.
  assert "eval_batch_size" not in evaluated["changed"] and not any(key.startswith("logging.")
                                                                   for key in evaluated["changed"])
  # An eval with its own settings says so in its row (it looked like the run's own eval before).
  result = launch(reference, "--mode=eval", "--config.eval_batch_size=4")
  assert result.returncode == 0, result.stderr[-3000:]
  evaluated = json.loads((reference / "eval_results.jsonl").read_text().splitlines()[-1])
  assert evaluated["changed"]["eval_batch_size"] == 4


@pytest.fixture(scope="module")
def reference_infer(reference):
  """The reference run's --mode=infer of a BOM, a blank line, a CRLF ending, and U+2028 (a character, not a line
  end; stripped as space): its output lines."""
  result = launch(reference, "--mode=infer", stdin="\ufeffabc\n\nhello\r\nxyz\u2028\n")
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout.split("\n")[:-1]


@pytest.mark.slow
def test_infer_mode_answers_each_input_line(reference_infer):
  outputs = reference_infer
  # Output line i answers input line i: the blank line gets a blank answer, not a shifted one.
  assert [len(line) for line in outputs] == [3, 0, 5, 3] and all(outputs[i].isalpha() for i in (0, 2, 3))


@pytest.mark.slow
def test_load_model_gives_the_checkpointed_model_and_its_inference(reference, reference_infer):
  from xattn_jax.training import loop
  model, task = loop.load_model(str(reference))
  helpers.assert_same_arrays(nnx.to_pure_dict(nnx.state(model)), helpers.checkpoint_item(reference, STEPS))
  assert task.infer(model, ["abc", "hello"]) == [reference_infer[0], reference_infer[2]]  # launch.py's answers


@pytest.mark.slow
@pytest.mark.parametrize("content, message", [
    (b"abc\n\nab1\n", "3: template input 'ab1'"),  # its number in the file, blank lines counted
    (b"abc\nab\xff\n", "2: not valid UTF-8 at byte 3"),
])
def test_infer_names_the_file_and_line_it_cannot_take(reference, tmp_path, content, message):
  inputs = tmp_path / "inputs.txt"
  inputs.write_bytes(content)
  result = launch(reference, "--mode=infer", f"--config.infer.input_file={inputs}")
  assert result.returncode == 2, result.stderr[-3000:]
  assert f"{inputs}:{message}" in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_changing_the_model_of_an_existing_run_is_refused(reference):
  result = launch(reference, "--config.model.d_model=64")
  assert result.returncode == 2
  assert "model.d_model" in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_early_stopping_ends_the_run_at_the_eval_that_exhausts_its_patience_and_records_it(tmp_path):
  """At a learning rate too small to move eval/loss by min_delta, evals at 4, 8 and 12 of 40: the best stays
  step 4's, and patience 2 ends the run at 12 with a checkpoint and early_stop.json. The same command then
  finds nothing to train (a dependency counts the run finished); a larger patience trains on to its own stop."""
  from xattn_jax.training import task as task_lib, validation
  workdir = tmp_path / "run"
  overrides = {"total_steps": 40, "optimizer.learning_rate": 1e-9, "early_stopping.patience": 2,
               "early_stopping.min_delta": 1e-3}
  result = launch(workdir, overrides=overrides)
  assert result.returncode == 0 and "Early stopping at step 12: eval/loss has not beaten" in result.stderr, \
      result.stderr[-3000:]
  assert checkpoint_steps(workdir)[-1] == 12 and max(r["step"] for r in metrics_rows(workdir)) == 12
  record = json.loads((workdir / "early_stop.json").read_text())
  losses = {row["step"]: row["eval/loss"] for row in metrics_rows(workdir) if "eval/loss" in row}
  assert record["step"] == 12 and record["best_step"] == min(losses, key=lambda step: (losses[step], step))
  config = validation.load_config_file(str(workdir / "config.py"))
  assert task_lib.reached_total_steps(config, str(workdir))
  config.early_stopping.patience = 3  # other settings: the record is not theirs
  assert not task_lib.reached_total_steps(config, str(workdir))
  again = launch(workdir, overrides=overrides)
  assert again.returncode == 0 and "The run stopped early at step 12" in again.stderr, again.stderr[-3000:]
  assert max(r["step"] for r in metrics_rows(workdir)) == 12
  more = launch(workdir, overrides={**overrides, "early_stopping.patience": 3})  # replays 4, 8, 12: one more eval
  assert more.returncode == 0 and "Early stopping at step 16" in more.stderr, more.stderr[-3000:]
  assert checkpoint_steps(workdir)[-1] == 16
  # trained on past its stop without early stopping: the record said 'stopped at 16' and blocked any later run
  on = launch(workdir, overrides={**overrides, "early_stopping.patience": 0, "total_steps": 20})
  assert on.returncode == 0 and checkpoint_steps(workdir)[-1] == 20, on.stderr[-3000:]
  assert not (workdir / "early_stop.json").exists()


@pytest.mark.slow
def test_eval_and_infer_read_the_best_checkpoint_when_told(tmp_path):
  """checkpoint.eval_from=best: the step whose eval ranks best by best_metric, not the latest. Here "best" is the
  highest eval/loss (best_mode=max, at a learning rate that only lowers it): step 4 of evals at 4, 8 and 12. A step
  named by its number goes through the same Trainer.latest_state -> checkpoints.steps_to_read, whose numbered case
  is test_checkpoints.py's test_a_step_named_by_its_number_is_read_if_kept_and_refused_naming_the_kept_ones_if_not
  (and test_validation.py's test_eval_from_is_latest_best_or_a_step_number)."""
  workdir = tmp_path / "run"
  overrides = {"total_steps": 12, "optimizer.learning_rate": 1e-3, "checkpoint.best_mode": "max",
               "checkpoint.keep": 1}
  result = launch(workdir, overrides=overrides)
  assert result.returncode == 0, result.stderr[-3000:]
  logged = {r["step"]: r["eval/loss"] for r in metrics_rows(workdir) if "eval/loss" in r}
  assert max(logged, key=logged.get) == 4 and checkpoint_steps(workdir) == [4, 12], (logged, checkpoint_steps(workdir))
  for eval_from, step in (("best", 4), ("latest", 12)):
    evaluated = launch(workdir, "--mode=eval", f"--config.checkpoint.eval_from={eval_from}", overrides=overrides)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    row = json.loads((workdir / "eval_results.jsonl").read_text().splitlines()[-1])
    assert row["step"] == step and row["eval/loss"] == pytest.approx(logged[step], rel=1e-5), (row, logged)
    # which step was read, said either way (the newest was read unsaid: an eval or infer beside a training run
    # answered from whichever step it found)
    assert (f"Reading checkpoint step {step} (checkpoint.eval_from='best'" if eval_from == "best" else
            f"Read checkpoint step {step}, the newest readable in ") in evaluated.stderr, evaluated.stderr[-3000:]
  from xattn_jax.training import loop
  model, _ = loop.load_model(str(workdir), overrides={"checkpoint.eval_from": "best"})
  helpers.assert_same_arrays(nnx.to_pure_dict(nnx.state(model)), helpers.checkpoint_item(workdir, 4))
  refused = launch(workdir, "--mode=eval", "--config.checkpoint.eval_from=best", "--config.checkpoint.best_metric=",
                   overrides=overrides)
  assert refused.returncode == 2 and "config.checkpoint.eval_from='best': needs checkpoint.best_metric" in \
      refused.stderr.strip().splitlines()[-1], refused.stderr[-3000:]


# --- interruption and exact resume --------------------------------------------------------------

@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sigterm") / "run"
  process = start(workdir, overrides={"debug.step_delay_s": 0.5})
  wait_for(lambda: (workdir / "metrics.jsonl").exists() and len(metrics_rows(workdir)) >= 2, process)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=240)
  stopped = {"returncode": process.returncode, "steps": checkpoint_steps(workdir), "stderr": stderr}
  resumed = launch(workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  return workdir, stopped


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_mid_run_and_exits_zero(sigterm_run):
  _, stopped = sigterm_run
  assert stopped["returncode"] == 0, stopped["stderr"][-3000:]
  assert stopped["steps"] and stopped["steps"][-1] < STEPS
  # its last line says where it stopped and how to go on (it ended on the signal's notice alone)
  last = stopped["stderr"].strip().splitlines()[-1]
  assert f"Stopped at step {stopped['steps'][-1]} of {STEPS} (SIGTERM or Ctrl-C)" in last, last
  assert "run the same command again to resume" in last


@pytest.mark.slow
def test_resume_after_sigterm_logs_the_same_losses_and_parameters(sigterm_run, reference):
  workdir, _ = sigterm_run
  assert train_losses(workdir) == train_losses(reference)
  helpers.assert_same_arrays(helpers.checkpoint_item(workdir, STEPS), helpers.checkpoint_item(reference, STEPS))


def ctrl_c(workdir, presses: int):
  """Starts a slowed-down run, presses Ctrl-C `presses` times (0.1 s apart) once it has logged two
  rows, and returns (its exit status, its stderr)."""
  process = start(workdir, overrides={"debug.step_delay_s": 0.5})
  wait_for(lambda: (workdir / "metrics.jsonl").exists() and len(metrics_rows(workdir)) >= 2, process)
  for press in range(presses):
    if press:
      time.sleep(0.1)
    process.send_signal(signal.SIGINT)
  _, stderr = process.communicate(timeout=240)
  return process.returncode, stderr


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_mid_run_like_sigterm(tmp_path):
  workdir = tmp_path / "run"
  returncode, stderr = ctrl_c(workdir, presses=1)
  assert returncode == 0, stderr[-3000:]
  steps = checkpoint_steps(workdir)
  assert steps and steps[-1] < STEPS and steps[-1] == max(row["step"] for row in metrics_rows(workdir))


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_in_one_line_keeping_the_metrics(tmp_path):
  workdir = tmp_path / "run"
  returncode, stderr = ctrl_c(workdir, presses=2)
  assert returncode == 130, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert stderr.strip().splitlines()[-1].startswith("launch.py: interrupted by a second Ctrl-C, without saving")
  assert len(metrics_rows(workdir)) >= 2


def test_a_first_ctrl_c_before_training_takes_it_over_is_not_called_a_second(tmp_path):
  """Ctrl-C while the task read its data or compiled stopped with "interrupted by a second Ctrl-C"."""
  sys.path.insert(0, str(REPO))
  import launch as launcher
  from xattn_jax.training import guards
  guards.clear_stop_request()
  assert launcher.interrupted_line(str(tmp_path), "train").startswith("interrupted by Ctrl-C, without saving; last "
                                                                       "checkpoint: none")
  assert launcher.interrupted_line(str(tmp_path), "infer") == "interrupted by Ctrl-C"  # waiting for its input
  guards.note_stop_request()  # the first press, taken by training's handler
  try:
    assert launcher.interrupted_line(str(tmp_path), "train").startswith("interrupted by a second Ctrl-C, without "
                                                                         "saving")
  finally:
    guards.clear_stop_request()


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_in_one_line_and_kept(tmp_path, reference):
  # Without config.json the config check cannot see the change; the checkpoint's shapes do.
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "config.json").unlink()
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  result = launch(workdir, "--mode=eval", overrides={"model.d_model": 48})
  assert result.returncode == 2, result.stderr[-3000:]
  last_line = result.stderr.strip().splitlines()[-1]
  assert "holds another model" in last_line and "48] in this config" in last_line
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
  assert not (workdir / "corrupt_checkpoints").exists()
  # Training with that config is refused the same way, and does not leave its config behind as
  # the run's (it used to replace config.json / config.py before the checkpoint was read).
  result = launch(workdir, overrides={"model.d_model": 48})
  assert result.returncode == 2 and "holds another model" in result.stderr.strip().splitlines()[-1]
  assert not (workdir / "config.json").exists()
  assert (workdir / "config.py").read_text() == (reference / "config.py").read_text()


@pytest.mark.slow
def test_total_steps_below_the_runs_step_is_refused_and_the_config_kept(tmp_path, reference):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  result = launch(workdir, overrides={"total_steps": STEPS // 2})
  assert result.returncode == 2, result.stderr[-3000:]
  assert f"config.total_steps={STEPS // 2}: the run in" in result.stderr and f"already at step {STEPS}" in result.stderr
  assert json.loads((workdir / "config.json").read_text())["total_steps"] == STEPS


@pytest.mark.slow
def test_a_run_whose_init_from_is_gone_launches_again_from_its_own_checkpoints(tmp_path, reference):
  """launch.py checks the config before the loop does: it too must know that a run with checkpoints reads no
  init_from (it refused 'config.init_from=...: no such checkpoint directory')."""
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  result = launch(workdir, overrides={"init_from": str(tmp_path / "deleted" / "checkpoints")})
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"The run is already at step {STEPS}" in result.stderr


@pytest.mark.slow
def test_a_run_that_failed_before_its_first_checkpoint_does_not_lock_the_workdir(tmp_path):
  """Its config.json is not a run to protect: the corrected rerun used to be refused as a change."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps({"model": {"d_model": 999}, "task": {}, "data": {}}))
  result = launch(workdir, overrides={"total_steps": 2})
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / "config.json").read_text())["model"]["d_model"] != 999
  # The first logged row has no steps/s yet: the key is left out rather than written as NaN. The run's one
  # call still logs its rate at the end, compile included.
  assert "train/steps_per_second" not in metrics_rows(workdir)[0]
  assert re.search(r"Trained 2 steps at [\d.]+ steps/s \([\d.]+ s from the first call's dispatch", result.stderr)
  assert all(value == value for row in metrics_rows(workdir) for value in row.values())


@pytest.mark.parametrize("mode", ["eval", "infer"])
def test_eval_or_infer_without_a_run_says_so_and_writes_nothing(tmp_path, mode):
  workdir = tmp_path / "missing"
  result = launch(workdir, f"--mode={mode}", stdin="abc\n")
  assert result.returncode == 1 and "no checkpoint" in result.stderr.strip().splitlines()[-1]
  assert not workdir.exists()


@pytest.fixture(scope="module")
def sigkill_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sigkill") / "run"
  process = start(workdir, overrides={"debug.step_delay_s": 0.5})
  wait_for(lambda: (workdir / "checkpoints" / "4").exists(), process)
  process.kill()
  process.communicate(timeout=60)
  killed_steps = checkpoint_steps(workdir)
  resumed = launch(workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  return workdir, killed_steps


@pytest.mark.slow
def test_resume_after_sigkill_logs_the_same_losses_and_parameters(sigkill_run, reference):
  workdir, killed_steps = sigkill_run
  assert killed_steps == [4]
  assert train_losses(workdir) == train_losses(reference)
  helpers.assert_same_arrays(helpers.checkpoint_item(workdir, STEPS), helpers.checkpoint_item(reference, STEPS))


# --- at XLA's default optimization level ---------------------------------------------------------

@pytest.fixture(scope="module")
def default_optimization_runs(tmp_path_factory):
  """Every run above compiles at optimization level 0. Here XLA's default level: a run at the
  config's default steps_per_call, the same with one step per call, and a copy of the first with
  its last checkpoint removed, resumed from step 4."""
  from configs import common
  root = tmp_path_factory.mktemp("default_optimization")
  overrides = {"steps_per_call": common.base_config().steps_per_call}  # calls of 4 steps: ends at 4 and 8
  runs = {"default": root / "default", "one_per_call": root / "one_per_call"}
  for name, per_call in (("default", overrides), ("one_per_call", {"steps_per_call": 1})):
    result = launch(runs[name], overrides=per_call, default_optimization=True)
    assert result.returncode == 0, result.stderr[-3000:]
  runs["resumed"] = root / "resumed"
  shutil.copytree(runs["default"], runs["resumed"])
  shutil.rmtree(runs["resumed"] / "checkpoints" / str(STEPS))
  result = launch(runs["resumed"], overrides=overrides, default_optimization=True)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Resuming from checkpoint step 4" in result.stderr
  return runs


@pytest.mark.slow
def test_resume_is_exact_at_the_default_optimization_level(default_optimization_runs):
  runs = default_optimization_runs
  assert train_losses(runs["resumed"]) == train_losses(runs["default"])
  helpers.assert_same_arrays(helpers.checkpoint_item(runs["resumed"], STEPS),
                             helpers.checkpoint_item(runs["default"], STEPS))


@pytest.mark.slow
def test_one_step_per_call_equals_the_default_grouping_at_the_default_optimization_level(default_optimization_runs):
  runs = default_optimization_runs
  assert train_losses(runs["one_per_call"]) == train_losses(runs["default"])
  helpers.assert_same_arrays(helpers.checkpoint_item(runs["one_per_call"], STEPS),
                             helpers.checkpoint_item(runs["default"], STEPS))


# --- failures -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, reference):
  workdir = tmp_path / "run"
  result = launch(workdir, overrides={"debug.nan_at_step": 6})
  assert result.returncode == 1
  last_line = result.stderr.strip().splitlines()[-1]
  assert "TrainingDiverged" in last_line and "step 6" in last_line
  assert checkpoint_steps(workdir) == [4]
  assert max(train_losses(workdir)) == 5
  helpers.assert_same_arrays(helpers.checkpoint_item(workdir, 4), helpers.checkpoint_item(reference, 4))


@pytest.mark.slow
def test_corrupted_latest_checkpoint_falls_back_to_the_older_one(tmp_path, reference):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  for path in (workdir / "checkpoints" / "8" / "model").rglob("*"):
    if path.is_file():
      path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])  # truncated files
  result = launch(workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "step 8" in result.stderr and "cannot be read" in result.stderr
  assert list((workdir / "corrupt_checkpoints").iterdir())
  assert train_losses(workdir) == train_losses(reference)
  helpers.assert_same_arrays(helpers.checkpoint_item(workdir, STEPS), helpers.checkpoint_item(reference, STEPS))


def test_eval_of_a_run_in_a_folder_it_cannot_write_is_a_one_line_error_and_infer_is_not(tmp_path, monkeypatch):
  """Eval of a run on read-only storage wrote its plots and eval_results.jsonl only after evaluating, and ended in
  an OSError traceback; infer only reads."""
  sys.path.insert(0, str(REPO))
  import launch as launcher
  run = tmp_path / "run"
  run.mkdir()
  writable = os.access
  monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK and writable(path, mode))
  assert launcher.workdir_problem(str(run), "eval") == (
      f"is not writable, and eval records its result there (eval_results.jsonl, plots): copy the run to a folder "
      f"you can write, or use --mode=infer, which records no result")
  assert launcher.workdir_problem(str(run), "infer") is None
  assert launcher.workdir_problem(str(tmp_path / "none"), "eval") is None  # no run there: eval says so


def test_a_data_file_a_moved_run_names_at_its_old_path_is_refused_saying_how_to_name_it_where_it_is(tmp_path):
  """A run copied elsewhere without its data file at the old path: eval told to use the run's own config.py, the
  one that named the missing file, and training said only "no such file"."""
  sys.path.insert(0, str(REPO))
  import launch as launcher
  from xattn_jax.training import validation
  (tmp_path / "config.py").write_text("")
  (tmp_path / "data_files.json").write_text(json.dumps(
      {"data.train_file": {"path": "/old/corpus.txt", "bytes": 3, "sha256": "0" * 64}}))
  error = validation.ConfigError("data.train_file", "/old/corpus.txt", "no such file")
  for mode in ("train", "eval"):
    assert launcher.config_error_line(error, str(tmp_path), mode) == (
        f"config.data.train_file='/old/corpus.txt': no such file (the run in {tmp_path} read it there; if it moved, "
        f"name it where it is now: --config.data.train_file=PATH)")
