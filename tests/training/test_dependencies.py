"""The dependency engine (`xattn_jax.training.dependencies`): a task's declared runs are trained when
missing, loaded when finished, refused when made with another config, and never touched by eval / infer.
The dependent task here is the template task declaring one template run (`task.dependency`)."""
import dataclasses
import os
import pathlib
import signal
import sys
import threading
import time
import types

import pytest

from configs import template
from tests import helpers
from xattn_jax.tasks.template import TemplateTask
from xattn_jax.training import checkpoints, dependencies, loop, metrics, task as task_lib, validation
from xattn_jax.training import workdir as workdir_lib
from xattn_jax.training.errors import DataError

# The runs this process trains (in turn, or a dependency stopped mid-run) compile the same small programs again and
# again, and so do the launch.py subprocesses training side by side (they inherit this process's XLA flags): each a
# cache hit after the first (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_in_process")

QUICK = {"total_steps": 2, "log_every_steps": 1, "eval_every_steps": 2, "checkpoint.every_steps": 2,
         "eval_batch_size": 8, "task.num_eval_examples": 8, "optimizer.warmup_steps": 1,
         "logging.tensorboard": False, "logging.plot": False}


class DependentTask(TemplateTask):
  """The template task, needing the run `config.task.dependency` in `config.task.dependency_workdir`."""

  @classmethod
  def dependencies(cls, config, workdir):
    return [task_lib.Dependency(workdir=config.task.dependency_workdir, config=config.task.dependency,
                                workdir_field="task.dependency_workdir")]


def dependency_config(**overrides):
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({**QUICK, **overrides})
  return config


def dependent_config(dependency_workdir, dependency=None):
  config = dependency_config()
  config.task.name = f"{__name__}:DependentTask"
  config.task.dependency_workdir = str(dependency_workdir)
  config.task.dependency = dependency or dependency_config()
  return config


def fake_run(workdir, config, steps):
  """A workdir as a run of `config` leaves it: its config.json and checkpoints (empty) at `steps`."""
  for step in steps:
    os.makedirs(os.path.join(workdir, "checkpoints", str(step)))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort())


@pytest.fixture
def no_training(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("loop.run was called")

  monkeypatch.setattr(loop, "run", refuse)


def test_a_finished_dependency_is_loaded_without_training(tmp_path, no_training):
  fake_run(str(tmp_path / "dependency"), dependency_config(), steps=[2])
  config = dependent_config(tmp_path / "dependency")
  assert [d.workdir for d in dependencies.resolve(config, str(tmp_path / "run"))] == [str(tmp_path / "dependency")]


def test_a_dependency_run_made_with_another_config_is_refused_naming_the_field(tmp_path, no_training):
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"model.d_model": 48}), steps=[1])
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.dependency_workdir=.*its model\.d_model=32, "
                     r"but the run in .* was made with 48") as refused:
    dependencies.resolve(dependent_config(tmp_path / "dependency"), str(tmp_path / "run"))
  assert refused.value.field == "task.dependency_workdir"


def test_a_dependency_run_whose_data_file_was_edited_in_place_is_refused_naming_it(tmp_path, no_training):
  """Captions rewritten in the same pairs file: the VLM loaded the encoder and LM trained on the old ones (exact
  match 0, one warning about unknown characters)."""
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("a.png\ta cat\n")
  def with_file():  # the template task reads no file: a data section as a task that reads one has
    config = dependency_config()
    config.data = {"train_file": str(pairs)}
    return config

  fake_run(str(tmp_path / "dependency"), with_file(), steps=[2])
  workdir_lib.record_data_files(with_file(), str(tmp_path / "dependency"))
  config = dependent_config(tmp_path / "dependency", with_file())
  dependencies.resolve(config, str(tmp_path / "run"))  # unchanged: loaded
  pairs.write_text("a.png\ta dog\n")  # the same size, other contents
  with pytest.raises(validation.ConfigError, match=r"was trained on data\.train_file .*pairs\.tsv \(same size, other "
                                                   r"contents\): the file changed since"):
    dependencies.resolve(config, str(tmp_path / "run"))
  pairs.write_text("a.png\ta zebra quokka\n")
  with pytest.raises(validation.ConfigError, match=r"\(12 bytes then, 21 now\)"):
    dependencies.resolve(config, str(tmp_path / "run"))


def test_a_finished_dependency_run_with_other_optimizer_settings_is_loaded(tmp_path, no_training):
  """Only the model, task and data sections define a run (as for resuming one); the rest may differ."""
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"optimizer.learning_rate": 0.1}), steps=[2])
  dependencies.resolve(dependent_config(tmp_path / "dependency"), str(tmp_path / "run"))


def test_a_finished_dependency_run_with_other_compute_fields_is_loaded(tmp_path, no_training):
  """A frozen ViT trained with --config.model.remat=full (to fit memory) was refused by the Q-Former declaring
  configs/vit_digits.py (remat 'none'), though its parameters are those the declared config builds: remat, scan and
  the attention kernel may change on resume (workdir.COMPUTE_FIELDS), so they may here too."""
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"model.remat": "full", "model.scan_layers": True}),
           steps=[2])
  dependencies.resolve(dependent_config(tmp_path / "dependency"), str(tmp_path / "run"))


def test_a_finished_dependency_differing_only_in_its_unchecked_fields_is_loaded(tmp_path, no_training):
  """The VLM's pairs LM only evaluates on the VLM's eval file: another eval file retrained it (4 minutes)."""
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"task.num_eval_examples": 16}), steps=[2])
  declared = task_lib.Dependency(workdir=str(tmp_path / "dependency"), config=dependency_config(),
                                 workdir_field="task.dependency_workdir")
  with pytest.raises(validation.ConfigError, match=r"its task\.num_eval_examples=8"):
    dependencies.check(declared)
  dependencies.check(dataclasses.replace(declared, unchecked_fields=("task.num_eval_examples",)))


def test_a_dependency_run_its_own_config_finished_is_not_trained_on_by_another_total_steps(tmp_path, no_training):
  """A user's 2-step run named as the dependency of a config declaring 4 steps was trained on to 4 and its
  record rewritten; now it is refused, naming how to use it as it is (its own config.py) or train it on."""
  run = tmp_path / "dependency"
  fake_run(str(run), dependency_config(), steps=[2])  # QUICK's total_steps=2: ended there
  declared = dependency_config(**{"total_steps": 4})
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.dependency_workdir=.*ended at its own "
                     r"total_steps=2, where this config trains it on to total_steps=4.*--config\.total_steps=4"):
    dependencies.resolve(dependent_config(run, declared), str(tmp_path / "run"))
  (run / "config.py").write_text(workdir_lib.config_file_text(dependency_config(), "the run's own config"))
  by_file = task_lib.Dependency(workdir=str(run), config=str(run / "config.py"), config_field="task.dependency",
                                workdir_field="task.dependency_workdir")
  dependencies.check(by_file)  # its own config: finished, loaded as it is
  assert dependencies.is_finished(by_file)
  (run / task_lib.EARLY_STOP_FILE).write_text("{}")  # stopped early under settings the declared config lacks
  with pytest.raises(validation.ConfigError, match=r"stopped early at step 2"):
    dependencies.check(dataclasses.replace(by_file, config=declared))


def test_an_interrupted_dependency_run_is_resumed_to_the_declared_steps(tmp_path, no_training):
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"total_steps": 4}), steps=[2])
  declared = task_lib.Dependency(workdir=str(tmp_path / "dependency"), config=dependency_config(total_steps=4),
                                 workdir_field="task.dependency_workdir")
  dependencies.check(declared)
  assert not dependencies.is_finished(declared)


@pytest.mark.parametrize("mode", ["eval", "infer"])
def test_eval_and_infer_resolve_no_dependency(tmp_path, no_training, mode):
  config = dependent_config(tmp_path / "dependency")
  assert dependencies.resolve(config, str(tmp_path / "run"), mode) == []
  assert os.listdir(tmp_path) == []


def test_a_task_cannot_depend_on_its_own_workdir(tmp_path, no_training):
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.dependency_workdir="):
    dependencies.resolve(dependent_config(tmp_path / "run"), str(tmp_path / "run"))


def test_an_empty_dependency_workdir_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch,
                                                                                  no_training):
  """`--config.model.lm_workdir=` trained the LM into the directory launch.py ran in."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.task\.dependency_workdir='': must name the directory of the run"):
    dependencies.resolve(dependent_config(""), str(tmp_path / "run"))
  assert os.listdir(tmp_path) == []


def test_a_dependency_config_file_that_is_missing_names_its_field(tmp_path):
  dependency = task_lib.Dependency(workdir=str(tmp_path), config="configs/no_such.py:size=tiny",
                                   workdir_field="model.encoder_workdir", config_field="model.encoder_config")
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.encoder_config='configs/no_such\.py:size=tiny'"):
    dependencies.config_of(dependency)


def test_a_stopped_dependency_ends_the_job_with_status_zero(tmp_path, monkeypatch):
  """Ctrl-C while the dependency trains: it saves a checkpoint, and the job stops there (status 0),
  not by training what depends on a half-trained run."""
  dependency = dependency_config(**{"total_steps": 3, "steps_per_call": 1, "debug.step_delay_s": 0.001,
                                    "checkpoint.every_steps": 3, "eval_every_steps": 3})

  def sleep_after_ctrl_c(seconds):  # the loop's pause after each call: a Ctrl-C arrives during the first
    signal.raise_signal(signal.SIGINT)

  monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=loop.time.perf_counter,
                                                          sleep=sleep_after_ctrl_c))
  with pytest.raises(SystemExit) as stopped:
    dependencies.resolve(dependent_config(tmp_path / "dependency", dependency), str(tmp_path / "run"))
  assert stopped.value.code == 0
  assert f"{tmp_path / 'dependency'} (task.dependency_workdir) saved at step 1 of 3" in str(stopped.value)
  assert "\n" not in str(stopped.value) and checkpoints.step_numbers(str(tmp_path / "dependency")) == [1]


def test_a_stop_asked_in_a_dependencys_last_call_lets_it_finish_and_trains_nothing_after_it(tmp_path, monkeypatch):
  """The last call's SIGTERM or Ctrl-C was lost: the dependency finished, and the run that needs it trained to its
  end (in a README trial, 1000 VLM steps after a SIGTERM)."""
  dependency = dependency_config(**{"total_steps": 3, "steps_per_call": 1, "debug.step_delay_s": 0.001,
                                    "checkpoint.every_steps": 3, "eval_every_steps": 3})
  pauses = []

  def ctrl_c_in_the_last_call(seconds):  # the loop's pause after each call
    pauses.append(seconds)
    if len(pauses) == 3:
      signal.raise_signal(signal.SIGINT)

  monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=loop.time.perf_counter,
                                                          sleep=ctrl_c_in_the_last_call))
  with pytest.raises(SystemExit) as stopped:
    dependencies.resolve(dependent_config(tmp_path / "dependency", dependency), str(tmp_path / "run"))
  assert stopped.value.code == 0 and checkpoints.step_numbers(str(tmp_path / "dependency")) == [3]
  assert str(stopped.value).startswith("Stopped (SIGTERM or Ctrl-C) as task.dependency_workdir finished: run the "
                                       "same command again to train the run that needs it"), str(stopped.value)
  monkeypatch.undo()  # the next start trains nothing more here, and is not stopped by the signal of the last one
  assert dependencies.resolve(dependent_config(tmp_path / "dependency", dependency), str(tmp_path / "run"))


class TwoDependencyTask(TemplateTask):
  """The template task, needing two runs: `task.dependency` and `task.second`, independent of each other."""

  @classmethod
  def dependencies(cls, config, workdir):
    return [task_lib.Dependency(workdir=config.task.dependency_workdir, config=config.task.dependency,
                                workdir_field="task.dependency_workdir"),
            task_lib.Dependency(workdir=config.task.second_workdir, config=config.task.second,
                                workdir_field="task.second_workdir")]


class FailingOnceTheOtherTrainsTask(TemplateTask):
  """The template task whose data cannot be read, found once the run in `config.task.other_workdir` has logged a
  training step (in the subprocess that trains it): the other has work to keep by then."""

  def __init__(self, config, workdir=None, mode="train"):
    wait_until_training(pathlib.Path(config.task.other_workdir))
    raise DataError("pairs.tsv:3: no tab between the image path and the text")


def two_dependent_config(folder, first=None, second=None):
  config = dependent_config(folder / "first", first)
  config.task.name = f"{__name__}:TwoDependencyTask"
  config.task.second_workdir = str(folder / "second")
  config.task.second = second or dependency_config(seed=1)
  return config


def wait_until_training(*workdirs, timeout_s=300):
  """Until each workdir's run has logged a training step: its loop handles SIGTERM by then (a signal during
  its imports or compile ends it at once, with nothing to save; metrics.jsonl exists from before the first step)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    logs = [workdir / "metrics.jsonl" for workdir in workdirs]
    if all(log.exists() and any("train/loss" in row for row in metrics.read_metrics(str(log))) for log in logs):
      return
    time.sleep(0.2)
  pytest.fail(f"not every one of {workdirs} logged a training step within {timeout_s} s")


def test_missing_dependencies_train_side_by_side_in_subprocesses_as_the_runs_trained_in_turn(
    tmp_path, monkeypatch, capfd):
  """In turn (this process trains each missing dependency in its workdir, and only the dependencies), then side by
  side: the same losses and checkpoints."""
  resolved = dependencies.resolve(two_dependent_config(tmp_path / "in_turn"), str(tmp_path / "in_turn" / "run"))
  assert [dependency.workdir for dependency in resolved] == [str(tmp_path / "in_turn" / n) for n in ("first", "second")]
  assert [checkpoints.step_numbers(dependency.workdir) for dependency in resolved] == [[2], [2]]
  assert not os.path.exists(tmp_path / "in_turn" / "run")  # only the dependencies ran
  monkeypatch.setattr(loop, "run", lambda *args, **kwargs: pytest.fail("trained in the test's process"))
  dependencies.resolve(two_dependent_config(tmp_path / "side"), str(tmp_path / "side" / "run"), side_by_side=True)
  for name in ("first", "second"):
    assert checkpoints.step_numbers(str(tmp_path / "side" / name)) == [2]
    side, in_turn = (metrics.read_metrics(str(tmp_path / way / name / "metrics.jsonl")) for way in ("side", "in_turn"))
    assert [row["train/loss"] for row in side if "train/loss" in row] == [
        row["train/loss"] for row in in_turn if "train/loss" in row]
    for item in ("model", "optimizer"):
      side, in_turn = (helpers.checkpoint_item(tmp_path / way / name, 2, item) for way in ("side", "in_turn"))
      helpers.assert_same_arrays(side, in_turn)
  output = capfd.readouterr().err
  assert "[task.dependency_workdir] " in output and "[task.second_workdir] " in output  # each one's lines, named
  assert not os.path.exists(tmp_path / "side" / "run")


def test_sigterm_stops_the_dependencies_training_side_by_side_each_saving_and_the_job_ends_with_status_zero(
    tmp_path):
  slow = {"total_steps": 10_000, "steps_per_call": 1, "debug.step_delay_s": 0.05, "checkpoint.every_steps": 10_000,
          "eval_every_steps": 10_000}
  config = two_dependent_config(tmp_path, dependency_config(**slow), dependency_config(seed=1, **slow))

  def sigterm_once_both_train():
    wait_until_training(tmp_path / "first", tmp_path / "second")
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=sigterm_once_both_train, daemon=True).start()
  with pytest.raises(SystemExit) as stopped:
    dependencies.resolve(config, str(tmp_path / "run"), side_by_side=True)
  assert stopped.value.code == 0 and "\n" not in str(stopped.value)
  for name, field in (("first", "task.dependency_workdir"), ("second", "task.second_workdir")):
    step = max(checkpoints.step_numbers(str(tmp_path / name)))
    assert 0 < step < 10_000  # saved where it stopped
    assert f"{tmp_path / name} ({field}) saved at step {step} of 10000" in str(stopped.value)


def test_a_dependency_failing_side_by_side_stops_the_other_with_a_checkpoint_and_ends_the_job_with_its_status_and_line(
    tmp_path):
  """launch.py: the other run is mid-training when the first fails: it saves where it is (its work kept for the next
  start, which resumes it there), and is not trained on to its end; the job ends with the failed run's status
  (DependencyFailed's code) and a last line naming it, then relaying its own last line."""
  failing = dependency_config(**{"task.name": f"{__name__}:FailingOnceTheOtherTrainsTask"})
  failing.task.other_workdir = str(tmp_path / "second")
  slow = dependency_config(seed=1, **{"total_steps": 10_000, "steps_per_call": 1, "debug.step_delay_s": 0.05,
                                      "checkpoint.every_steps": 10_000, "eval_every_steps": 10_000})
  config_file = tmp_path / "config.py"
  config_file.write_text(workdir_lib.config_file_text(two_dependent_config(tmp_path, failing, slow),
                                                      "two dependencies"))
  result = helpers.launch(str(config_file), tmp_path / "run")
  assert result.returncode == 2, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"launch.py: the training of task.dependency_workdir in {tmp_path / 'first'} failed "
                         "(exit status 2): launch.py: "), last
  assert last.endswith("pairs.tsv:3: no tab between the image path and the text")  # its last line
  assert "[task.second_workdir] " in result.stderr and not (tmp_path / "run").exists()
  assert 0 < max(checkpoints.step_numbers(str(tmp_path / "second")), default=0) < 10_000  # saved where it stopped


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_bad_dependency_config_fails_before_any_dependency_trains_naming_whose_it_is(tmp_path, no_training,
                                                                                       side_by_side):
  """Its field alone (`config.optimizer.learning_rate`) read as the dependent config's, which may have none."""
  config = two_dependent_config(tmp_path, second=dependency_config(**{"optimizer.learning_rate": -1.0}))
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.second_workdir='.*': the config of the run it "
                                                   r"names is invalid: config\.optimizer\.learning_rate=-1\.0"):
    dependencies.resolve(config, str(tmp_path / "run"), side_by_side=side_by_side)
  assert os.listdir(tmp_path) == []


def test_a_cycle_of_dependencies_is_refused_in_a_side_by_side_subprocess(tmp_path, monkeypatch, no_training):
  """A subprocess learns the runs waiting on its run from its environment, and refuses to train one of them."""
  waiting = [str(tmp_path / "top"), str(tmp_path / "dependency")]
  monkeypatch.setenv(dependencies.CHAIN_VARIABLE, os.pathsep.join(waiting))
  with pytest.raises(validation.ConfigError, match=r"is the workdir of a run that depends on it"):
    dependencies.resolve(dependent_config(tmp_path / "dependency"), str(tmp_path / "middle"))


@pytest.mark.parametrize("processes, backend, possible", [(1, "cpu", True), (2, "cpu", False), (1, "gpu", False)])
def test_side_by_side_only_for_one_process_on_cpu(monkeypatch, processes, backend, possible):
  monkeypatch.setattr(dependencies.jax, "process_count", lambda: processes)
  monkeypatch.setattr(dependencies.jax, "default_backend", lambda: backend)
  assert dependencies.side_by_side_possible() is possible


def test_two_dependencies_in_one_workdir_are_refused_before_either_trains(tmp_path, no_training):
  config = two_dependent_config(tmp_path)
  config.task.second_workdir = config.task.dependency_workdir
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.second_workdir=.* is task\.dependency_workdir too"):
    dependencies.resolve(config, str(tmp_path / "run"), side_by_side=True)
  assert os.listdir(tmp_path) == []


def test_dependencies_side_by_side_stop_with_a_checkpoint_when_their_launcher_is_killed(tmp_path):
  """SIGKILL reaches no handler: each subprocess sees its launcher gone, saves and frees its workdir."""
  slow = {"total_steps": 10_000, "steps_per_call": 1, "debug.step_delay_s": 0.05, "checkpoint.every_steps": 10_000,
          "eval_every_steps": 10_000}
  config_file = tmp_path / "config.py"
  config_file.write_text(workdir_lib.config_file_text(
      two_dependent_config(tmp_path, dependency_config(**slow), dependency_config(seed=1, **slow)), "slow ones"))
  launcher = helpers.start(helpers.launch_command(str(config_file), tmp_path / "run"), env=helpers.subprocess_env())
  wait_until_training(tmp_path / "first", tmp_path / "second")
  launcher.kill()
  launcher.communicate()
  for name in ("first", "second"):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      try:
        with workdir_lib.training_lock(str(tmp_path / name)):
          break  # its training process has ended
      except loop.RunError:
        time.sleep(0.2)
    else:
      pytest.fail(f"the {name} dependency still trains after its launcher was killed")
    assert 0 < max(checkpoints.step_numbers(str(tmp_path / name))) < 10_000  # saved where it stopped


# A stand-in for launch.py in the side-by-side subprocesses: it "trains" until asked to stop, then "saves" for
# longer than the test waits (a run finishes its call first); a second SIGTERM ends it.
SLOW_TO_SAVE = """
import pathlib, signal, sys, time
workdir = pathlib.Path(next(a for a in sys.argv if a.startswith("--workdir=")).split("=", 1)[1])
workdir.mkdir(parents=True, exist_ok=True)

def stop(signum, frame):
  if (workdir / "stopping").exists():
    sys.exit(0)
  (workdir / "stopping").touch()

signal.signal(signal.SIGTERM, stop)
(workdir / "training").touch()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
  time.sleep(0.05)
"""


def test_a_second_ctrl_c_while_dependencies_train_side_by_side_ends_the_job_at_once_with_status_130(tmp_path):
  """The first Ctrl-C asks each subprocess to save; the second ends the launcher without waiting for their saves,
  in one line (a terminal's Ctrl-C reaches the subprocesses too; here the launcher's own SIGTERM ends them)."""
  (tmp_path / "slow_to_save.py").write_text(SLOW_TO_SAVE)
  config_file = tmp_path / "config.py"
  config_file.write_text(workdir_lib.config_file_text(two_dependent_config(tmp_path), "two dependencies"))
  launch = ("import runpy, sys\nfrom xattn_jax.training import dependencies\n"
            f"dependencies._LAUNCH = {str(tmp_path / 'slow_to_save.py')!r}\n"
            f"sys.argv = {helpers.launch_command(str(config_file), tmp_path / 'run')[1:]!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
  launcher = helpers.start([sys.executable, "-c", launch], env=helpers.subprocess_env())

  def wait_for(name):
    deadline = time.monotonic() + 60
    while not all((tmp_path / run / name).exists() for run in ("first", "second")):
      assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
      time.sleep(0.05)

  wait_for("training")
  launcher.send_signal(signal.SIGINT)
  wait_for("stopping")
  launcher.send_signal(signal.SIGINT)
  _, stderr = launcher.communicate(timeout=60)
  assert launcher.returncode == 130, stderr[-3000:]
  assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith(
      "launch.py: interrupted by a second Ctrl-C, without saving"), stderr[-3000:]


def test_resuming_a_run_whose_dependency_workdir_is_gone_is_refused_not_trained_there_again(tmp_path, no_training):
  # A run copied or moved elsewhere (its dependency moved too, or deleted): training it on must not train a new
  # frozen part at the old path recorded for it; its checkpoints hold the frozen weights it trained with.
  config = dependent_config(tmp_path / "moved_away")
  fake_run(str(tmp_path / "run"), config, steps=[2])
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.dependency_workdir=.*moved_away.*holds no "
                     r"checkpoint.*moved or deleted.*eval and infer need only .*run"):
    dependencies.resolve(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "moved_away")
