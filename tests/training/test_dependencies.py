"""The dependency engine (`xattn_jax.training.dependencies`): a task's declared runs are trained when
missing, loaded when finished, refused when made with another config, and never touched by eval / infer.
The dependent task here is the template task declaring one template run (`task.dependency`)."""
import dataclasses
import os
import signal
import types

import pytest

from configs import template
from xattn_jax.tasks.template import TemplateTask
from xattn_jax.training import checkpoints, dependencies, loop, task as task_lib, validation

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


def test_a_missing_dependency_is_trained_in_its_workdir(tmp_path):
  config = dependent_config(tmp_path / "dependency")
  [dependency] = dependencies.resolve(config, str(tmp_path / "run"))
  assert dependency.workdir == str(tmp_path / "dependency")
  assert checkpoints.step_numbers(dependency.workdir) == [2]
  assert not os.path.exists(tmp_path / "run")  # only the dependency ran


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


def test_a_finished_dependency_run_with_other_optimizer_settings_is_loaded(tmp_path, no_training):
  """Only the model, task and data sections define a run (as for resuming one); the rest may differ."""
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"optimizer.learning_rate": 0.1}), steps=[2])
  dependencies.resolve(dependent_config(tmp_path / "dependency"), str(tmp_path / "run"))


def test_a_finished_dependency_differing_only_in_its_unchecked_fields_is_loaded(tmp_path, no_training):
  """The VLM's pairs LM only evaluates on the VLM's eval file: another eval file retrained it (4 minutes)."""
  fake_run(str(tmp_path / "dependency"), dependency_config(**{"task.num_eval_examples": 16}), steps=[2])
  declared = task_lib.Dependency(workdir=str(tmp_path / "dependency"), config=dependency_config(),
                                 workdir_field="task.dependency_workdir")
  with pytest.raises(validation.ConfigError, match=r"its task\.num_eval_examples=8"):
    dependencies.check(declared)
  dependencies.check(dataclasses.replace(declared, unchecked_fields=("task.num_eval_examples",)))


@pytest.mark.parametrize("mode", ["eval", "infer"])
def test_eval_and_infer_resolve_no_dependency(tmp_path, no_training, mode):
  config = dependent_config(tmp_path / "dependency")
  assert dependencies.resolve(config, str(tmp_path / "run"), mode) == []
  assert os.listdir(tmp_path) == []


def test_a_task_cannot_depend_on_its_own_workdir(tmp_path, no_training):
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.dependency_workdir="):
    dependencies.resolve(dependent_config(tmp_path / "run"), str(tmp_path / "run"))


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
  assert str(tmp_path / "dependency") in str(stopped.value) and "\n" not in str(stopped.value)
  assert checkpoints.step_numbers(str(tmp_path / "dependency")) == [1]
