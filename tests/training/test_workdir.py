"""The config record of a workdir: written, read back, compared with a new config."""
import json
import pathlib

import jax
import pytest
from flax import nnx

from configs import lm_text, template, translate_dates, translate_tsv, vlm_digits
from tests import helpers
from xattn_jax.training import loop, records, task as task_lib, validation, workdir
from xattn_jax.training.errors import DataError, RunError

# Their runs compile the same programs again and again: each a cache hit after the first (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_in_process")


def _config(**overrides):
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict(overrides)
  return config


def _with_checkpoint(path):
  (path / "checkpoints" / "4").mkdir(parents=True)


def test_the_written_config_py_loads_back_as_the_same_config(tmp_path):
  config = _config(total_steps=7, **{"model.d_model": 48})
  workdir.write_config(config, str(tmp_path))
  loaded = validation.load_config_file(str(tmp_path / "config.py"))
  assert json.loads(loaded.to_json()) == json.loads(config.to_json_best_effort())
  assert json.loads((tmp_path / "config.json").read_text())["model"]["d_model"] == 48
  assert "d_model: 48" in (tmp_path / "config.txt").read_text()


def test_a_config_equal_to_the_record_has_no_differences(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  assert workdir.config_differences(_config(), str(tmp_path)) == {}


def test_differences_name_each_changed_field_with_old_and_new_values_in_field_order(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  differences = workdir.config_differences(_config(total_steps=9, **{"model.d_model": 48}), str(tmp_path))
  assert list(differences) == ["model.d_model", "total_steps"]
  assert differences["model.d_model"] == (32, 48)


def test_a_workdir_without_a_record_has_no_differences(tmp_path):
  assert workdir.config_differences(_config(), str(tmp_path)) == {}


def test_changing_the_model_of_a_run_is_refused_naming_the_first_differing_field(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  changed = _config(**{"model.num_heads": 4, "model.mlp_dim": 128})
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.mlp_dim=128: the run in .* was made with 64"):
    workdir.check_same_model(changed, str(tmp_path))


def test_training_may_change_the_loop_but_not_the_task(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  workdir.check_same_model(_config(total_steps=5000, batch_size=4), str(tmp_path))
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.max_length"):
    workdir.check_same_model(_config(**{"task.max_length": 10}), str(tmp_path))


@pytest.mark.parametrize("mode", ["train", "eval", "infer"])
def test_how_the_model_computes_may_change_in_any_mode_and_how_its_weights_are_stored_only_to_read(tmp_path, mode):
  """A resumed run could not switch on remat (to fit memory) or another attention kernel, which leave the weights
  alone, while precision.param_dtype, which stores them otherwise, resumed with a warning."""
  workdir.write_config(_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  workdir.check_same_model(_config(**{"model.remat": "full", "model.implementation": "chunked"}), str(tmp_path),
                           mode=mode)
  stored_otherwise = _config(**{"precision.param_dtype": "bfloat16"})
  if mode == "train":
    with pytest.raises(validation.ConfigError, match=r"^config\.precision\.param_dtype='bfloat16': the run in .* was "
                                                     r"made with 'float32'; keep it, or use a new --workdir$"):
      workdir.check_same_model(stored_otherwise, str(tmp_path))
  else:
    workdir.check_same_model(stored_otherwise, str(tmp_path), mode=mode)


def test_eval_may_change_the_task_but_not_the_model(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  workdir.check_same_model(_config(**{"task.num_eval_examples": 8}), str(tmp_path), mode="eval")
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.d_model=48: .* made with 32; infer reads the "
                     r"model as it was trained: keep it$"):  # (a new --workdir holds no run to infer with)
    workdir.check_same_model(_config(**{"model.d_model": 48}), str(tmp_path), mode="infer")


@pytest.mark.parametrize("module, posenc", [(lm_text, "rope"), (lm_text, "alibi"), (lm_text, "learned"),
                                            (translate_dates, "sinusoidal"), (translate_dates, "rope"),
                                            (translate_dates, "learned")])
def test_an_eval_may_lengthen_the_context_and_rescale_rope_but_not_a_learned_table(tmp_path, module, posenc):
  """ALiBi's "train short, test long" is an eval at a longer model.max_length: it changes no parameter but a
  learned table's rows (the LM and the translator alike). Training may not change it; eval may not change the
  model's shape."""
  trained = module.get_config(f"posenc={posenc}")
  workdir.write_config(trained, str(tmp_path))
  _with_checkpoint(tmp_path)
  longer = module.get_config(f"posenc={posenc}")
  longer.model.max_length = 1024
  longer.model.rope_scaling, longer.model.rope_scaling_factor = ("ntk", 4.0) if posenc == "rope" else ("", 1.0)
  longer.model.implementation = "chunked"
  for mode in ("eval", "infer"):
    if posenc == "learned":
      with pytest.raises(validation.ConfigError, match=rf"^config\.model\.max_length=1024: the run .* made with "
                                                        rf"{trained.model.max_length}"):
        workdir.check_same_model(longer, str(tmp_path), mode=mode)
    else:
      workdir.check_same_model(longer, str(tmp_path), mode=mode)
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.max_length=1024"):  # the first (the kernel
    workdir.check_same_model(longer, str(tmp_path), mode="train")  # may change: COMPUTE_FIELDS)


@pytest.mark.parametrize("module", [lm_text, translate_dates])
def test_any_mode_may_scan_or_unroll_the_layers_of_a_run(tmp_path, module):
  """layer_stack keeps the same stacked parameters either way: a scanned run's eval, infer or resume unrolled was
  refused as if it read another model ("eval reads the model as it was trained")."""
  workdir.write_config(module.get_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  other = module.get_config()
  other.model.scan_layers = not other.model.scan_layers
  for mode in ("train", "eval", "infer"):
    workdir.check_same_model(other, str(tmp_path), mode=mode)


@pytest.mark.parametrize("spec", ["configs/template.py:size=tiny", "configs/lm_text.py:size=micro,tokenizer=bytes",
                                  "configs/algorithmic.py:size=micro", "configs/perceiver_digits.py",
                                  "configs/vit_digits.py"])
def test_scanned_and_unrolled_models_hold_the_same_parameters_so_one_checkpoint_serves_both(spec, tmp_path):
  """What lets any mode set model.scan_layers otherwise: the state a checkpoint restores has one tree of shapes."""
  states = []
  for scan in (False, True):
    config = helpers.load_config(f"--config={spec}", f"--config.model.scan_layers={scan}")
    task = task_lib.get_task_class(config.task.name)(config, str(tmp_path), "train")
    states.append(jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(helpers.abstract_model(task))))
  assert jax.tree.structure(states[0]) == jax.tree.structure(states[1]) and states[0] == states[1]


def test_a_run_made_before_a_model_field_existed_is_pointed_to_its_own_config(tmp_path):
  """Its config.json lacks the field, which the config file now sets: "made with None" read as if the run had
  chosen None. Its own config.py reads the field as the code of then did."""
  workdir.write_config(lm_text.get_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  recorded = json.loads((tmp_path / "config.json").read_text())
  del recorded["model"]["norm_type"]
  (tmp_path / "config.json").write_text(json.dumps(recorded))
  for mode in ("train", "eval"):
    with pytest.raises(validation.ConfigError, match=rf"^config\.model\.norm_type='rmsnorm': the run in .* was made "
                                                      rf"before this field existed; use its own config, "
                                                      rf"--config={tmp_path / 'config.py'}$"):
      workdir.check_same_model(lm_text.get_config(), str(tmp_path), mode=mode)


def test_an_eval_naming_no_file_of_a_run_trained_on_one_is_refused(tmp_path):
  """With data.train_file "" the LM scores the bundled corpus: an eval of a run trained on the user's
  text once recorded a perplexity of ~4,000 on it as the run's result."""
  trained = lm_text.get_config()
  trained.data.train_file = "/data/mine.txt"
  workdir.write_config(trained, str(tmp_path))
  _with_checkpoint(tmp_path)
  with pytest.raises(validation.ConfigError, match=r"^config\.data\.train_file='': the run in .* was trained on "
                     r"'/data/mine.txt' and this eval names no data file"):
    workdir.check_same_model(lm_text.get_config(), str(tmp_path), mode="eval")
  other = lm_text.get_config()
  other.data.eval_file = "/data/other.txt"  # another file to score is an eval's to choose
  workdir.check_same_model(other, str(tmp_path), mode="eval")
  workdir.check_same_model(lm_text.get_config(), str(tmp_path), mode="infer")  # infer reads no data file


def test_an_eval_holding_out_part_of_a_training_file_the_run_read_whole_is_refused(tmp_path):
  """A run trained on mine.txt and scored on its own eval file: an eval naming mine.txt alone held out 5% of it, lines
  the run trained on, and recorded their loss as the run's score."""
  trained = lm_text.get_config()
  trained.data.update({"train_file": "/data/mine.txt", "eval_file": "/data/eval.txt"})
  workdir.write_config(trained, str(tmp_path))
  _with_checkpoint(tmp_path)
  again = lm_text.get_config()
  again.data.train_file = "/data/mine.txt"
  with pytest.raises(validation.ConfigError, match=r"^config\.data\.eval_file='': the run in .* trained on every "
                     r"document of data.train_file and was scored on '/data/eval.txt'"):
    workdir.check_same_model(again, str(tmp_path), mode="eval")
  again.data.train_file = "/data/other.txt"  # held out of a file the run did not read: an eval's to choose
  workdir.check_same_model(again, str(tmp_path), mode="eval")


@pytest.mark.parametrize("field, value", [("data.eval_fraction", 0.5), ("data.corpus_seed", 5)])
def test_an_eval_scoring_the_held_out_part_keeps_the_fields_that_chose_it(tmp_path, field, value):
  """Another eval_fraction or corpus_seed at eval scored documents the run trained on, as eval/* metrics."""
  trained = lm_text.get_config()
  trained.data.train_file = "/data/mine.txt"
  workdir.write_config(trained, str(tmp_path))
  _with_checkpoint(tmp_path)
  changed = lm_text.get_config()
  changed.data.train_file = "/data/mine.txt"
  changed.update_from_flattened_dict({field: value})
  with pytest.raises(validation.ConfigError, match=rf"^config\.{field.replace('.', r'[.]')}={value}: the run in .* was "
                     r"made with .*it chooses the held-out part this eval scores"):
    workdir.check_same_model(changed, str(tmp_path), mode="eval")
  workdir.check_same_model(changed, str(tmp_path), mode="infer")  # infer reads no eval data
  changed.data.eval_file = "/data/other.txt"  # another file scored: its held-out part is not read
  workdir.check_same_model(changed, str(tmp_path), mode="eval")


def test_a_workdir_without_checkpoints_protects_nothing(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  workdir.check_same_model(_config(**{"model.d_model": 48}), str(tmp_path))


def test_an_eval_result_row_records_the_fields_the_eval_changed(tmp_path):
  workdir.write_config(_config(), str(tmp_path))
  workdir.append_eval_result(_config(), str(tmp_path), 8, {"eval/loss": 1.5})
  workdir.append_eval_result(_config(eval_batch_size=4), str(tmp_path), 8, {"eval/loss": 1.25})
  rows = [json.loads(line) for line in (tmp_path / "eval_results.jsonl").read_text().splitlines()]
  assert rows == [{"step": 8, "eval/loss": 1.5, "changed": {}},
                  {"step": 8, "eval/loss": 1.25, "changed": {"eval_batch_size": 4}}]


@pytest.mark.parametrize("config_file", ["qformer_digits", "vlm_digits"])
def test_eval_and_infer_may_name_other_dependency_workdirs_training_may_not(tmp_path, config_file):
  # eval / infer read the frozen parts from the run's checkpoint and record, never from these fields
  # (the workdirs, and the configs those parts were trained with)
  module = __import__(f"configs.{config_file}", fromlist=["get_config"])
  workdir.write_config(module.get_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  moved = module.get_config()
  fields = ["model.encoder_workdir", "model.encoder_config"] + (
      ["model.lm_workdir", "model.lm_config"] if config_file == "vlm_digits" else [])
  moved.update_from_flattened_dict({field: f"/elsewhere/{field}" for field in fields})
  for mode in ("eval", "infer"):
    workdir.check_same_model(moved, str(tmp_path), mode=mode)
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.encoder_config='/elsewhere"):
    workdir.check_same_model(moved, str(tmp_path))
  moved.model.num_heads += 1  # the model itself still may not change
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.num_heads"):
    workdir.check_same_model(moved, str(tmp_path), mode="infer")


def test_paths_are_made_absolute_and_a_record_of_typed_paths_names_the_same_files(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  (tmp_path / "run").mkdir()
  typed = translate_tsv.get_config()
  typed.update_from_flattened_dict({"data.train_file": "train.tsv", "init_from": "runs/a"})
  workdir.write_config(typed, str(tmp_path / "run"))  # a run recorded before its paths were made absolute
  launched = translate_tsv.get_config()
  launched.update_from_flattened_dict({"data.train_file": "train.tsv", "init_from": "runs/a"})
  workdir.absolute_paths(launched, str(tmp_path / "run"))
  assert (launched.data.train_file, launched.init_from) == (str(tmp_path / "train.tsv"), str(tmp_path / "runs/a"))
  assert (launched.data.eval_file, launched.infer.input_file) == ("", "-")  # unset; standard input
  launched.data.eval_file = "~/eval.tsv"
  workdir.absolute_paths(launched, str(tmp_path / "run"))
  assert launched.data.eval_file == str(tmp_path / "home" / "eval.tsv")
  launched.data.eval_file = ""
  assert workdir.config_differences(launched, str(tmp_path / "run")) == {}
  launched.data.train_file = str(tmp_path / "other.tsv")
  assert list(workdir.config_differences(launched, str(tmp_path / "run"))) == ["data.train_file"]
  vlm = vlm_digits.get_config()  # the dependencies' workdirs are paths too
  workdir.absolute_paths(vlm, None)
  assert vlm.model.encoder_workdir.startswith(str(tmp_path)) and vlm.model.lm_workdir.startswith(str(tmp_path))


def test_a_data_file_under_home_is_found_before_anything_runs(tmp_path, monkeypatch):
  """The shell leaves `~` after `=` as it is: --config.data.train_file=~/my.txt was refused as no such file."""
  monkeypatch.setenv("HOME", str(tmp_path))
  (tmp_path / "my.txt").write_text("one document\nanother one\n")
  config = lm_text.get_config("size=micro")
  config.data.train_file = "~/my.txt"
  with pytest.raises(RunError, match="no checkpoint"):  # past validation, which read the file
    loop.run(config, str(tmp_path / "run"), "eval")
  assert config.data.train_file == str(tmp_path / "my.txt")


def tiny_template(**overrides):
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"total_steps": 2, "log_every_steps": 1, "eval_every_steps": 2,
                                     "checkpoint.every_steps": 2, "eval_batch_size": 8, "task.num_eval_examples": 8,
                                     "optimizer.warmup_steps": 1, "logging.tensorboard": False,
                                     "logging.plot": False, **overrides})
  return config


def test_a_second_training_process_in_a_workdir_is_refused_naming_the_first_before_writing(tmp_path):
  """Two processes training into one workdir at once overwrite each other's config and checkpoints."""
  from xattn_jax.training import loop  # noqa: PLC0415 - jax only for this test
  run = tmp_path / "run"
  run.mkdir()
  with workdir.training_lock(str(run)):  # another open file: flock refuses it as it refuses another process
    with pytest.raises(loop.RunError, match=r"the workdir .*run is in use: process \d+ on .* trains there"):
      loop.run(tiny_template(), str(run), "train")
    assert not (run / "config.json").exists()
    loop.run(tiny_template(), str(run / "other"), "train")  # another workdir trains
  loop.run(tiny_template(), str(run), "train")  # the lock ends with its holder
  assert (run / "checkpoints" / "2").is_dir()


def test_eval_and_infer_read_a_workdir_while_a_process_trains_there_and_the_lock_file_names_its_last_holder(
    tmp_path):
  """README: eval and infer take no lock; the file stays after the run, naming the process that last held it."""
  import io
  import os
  import socket
  from xattn_jax.training import loop  # noqa: PLC0415 - jax only for this test
  run = tmp_path / "run"
  loop.run(tiny_template(), str(run))
  assert (run / workdir.LOCK_FILE).read_text() == f"process {os.getpid()} on {socket.gethostname()}\n"
  (tmp_path / "lines.txt").write_text("abc\n")
  with workdir.training_lock(str(run)):  # as another process training there would hold it
    assert "eval/loss" in loop.run(tiny_template(), str(run), "eval")
    assert loop.run(tiny_template(**{"infer.input_file": str(tmp_path / "lines.txt")}), str(run), "infer",
                    output=io.StringIO())


def test_training_in_a_folder_holding_a_config_file_no_run_wrote_is_refused_before_writing(tmp_path):
  """A folder of your own given as the workdir lost its config.py to the run's record, silently."""
  (tmp_path / "config.py").write_text("MY = 'experiment settings'\n")
  with pytest.raises(RunError, match=r"holds config.py that no run wrote, which training would overwrite"):
    loop.run(_config(), str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.py"]
  assert (tmp_path / "config.py").read_text() == "MY = 'experiment settings'\n"
  assert workdir.foreign_record_files(str(tmp_path / "new")) == []
  (tmp_path / "run").mkdir()
  workdir.write_config(_config(), str(tmp_path / "run"))  # a run's record: its own to rewrite
  assert workdir.foreign_record_files(str(tmp_path / "run")) == []
  (tmp_path / "run" / "config.json").write_text('{"task": {"name": "mine"}}')  # JSON, but no run's record
  assert workdir.foreign_record_files(str(tmp_path / "run")) == list(workdir.RECORD_FILES)


def test_training_in_a_folder_holding_a_log_or_plot_no_run_wrote_is_refused_before_writing(tmp_path):
  """A folder holding your own metrics.jsonl and loss.png had them rewritten by the run's."""
  (tmp_path / "metrics.jsonl").write_text("my notes, not JSON\n")
  (tmp_path / "loss.png").write_bytes(b"my plot")
  with pytest.raises(RunError, match=r"holds metrics.jsonl, loss.png that no run wrote"):
    loop.run(_config(), str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]
  assert (tmp_path / "metrics.jsonl").read_text() == "my notes, not JSON\n"


def test_training_on_over_an_edited_data_file_says_so_and_keeps_the_record_it_started_on(tmp_path, caplog):
  """A resumed run read an edited train file without a word (only a run depending on it checked the record)."""
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("a.png\ta cat\n")
  def with_file(**overrides):  # the template task reads no file: a data section as a task that reads one has
    config = tiny_template(**overrides)
    config.data = {"train_file": str(pairs)}
    return config

  run = tmp_path / "run"
  loop.run(with_file(), str(run))
  recorded = (run / workdir.DATA_RECORD).read_text()
  loop.run(with_file(total_steps=4), str(run))
  assert "edited since the run started" not in caplog.text
  pairs.write_text("a.png\ta dog\n")
  loop.run(with_file(total_steps=6), str(run))
  assert "Training on over data files edited since the run started: data.train_file" in caplog.text
  assert "(same size, other contents)" in caplog.text
  assert (run / workdir.DATA_RECORD).read_text() == recorded


def test_a_run_trained_on_with_other_settings_keeps_the_record_it_started_with(tmp_path, monkeypatch):
  """The record claimed the resumed settings (another learning rate, batch size) for every step of the run, and a
  command that trained nothing rewrote it too. And the run records its paths absolute, so its config.py reads the
  same files from any folder (it kept them as typed: --config=<workdir>/config.py from another folder found no
  file)."""
  run = str(tmp_path / "run")
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "notes.txt").write_text("a file of yours\n")
  monkeypatch.chdir(tmp_path / "data")
  loop.run(tiny_template(**{"infer.input_file": "notes.txt"}), "../run")  # paths as typed, in another folder
  monkeypatch.chdir(tmp_path)
  recorded = validation.load_config_file(str(tmp_path / "run" / "config.py"))
  assert recorded.infer.input_file == str(tmp_path / "data" / "notes.txt")
  started = (tmp_path / "run" / "config.json").read_text()
  assert json.loads((tmp_path / "run" / workdir.DATA_RECORD).read_text()) == {}  # no data file: only DATA_FIELDS
  loop.run(tiny_template(**{"optimizer.learning_rate": 0.5, "seed": 7}), run)  # at step 2 = total_steps: nothing
  assert (tmp_path / "run" / "config.json").read_text() == started
  assert not list(tmp_path.glob("run/*.before_step_*"))
  loop.run(tiny_template(total_steps=4, batch_size=8), run)
  assert sorted(p.name for p in tmp_path.glob("run/*.before_step_*")) == sorted(
      f"{name}.before_step_2" for name in workdir.RECORD_FILES)
  assert (tmp_path / "run" / "config.json.before_step_2").read_text() == started
  recorded = workdir.recorded_config(run)
  assert (recorded["total_steps"], recorded["batch_size"]) == (4, 8)
  loop.run(tiny_template(total_steps=6, batch_size=8), run)  # the same settings but the steps: a record of 4 kept
  assert json.loads((tmp_path / "run" / "config.json.before_step_4").read_text())["total_steps"] == 4
  assert json.loads((tmp_path / "run" / "config.json.before_step_2").read_text())["total_steps"] == 2


def _truncate_model_files(run, step):
  for path in (run / "checkpoints" / str(step) / "model").rglob("*"):
    if path.is_file():
      path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])


def test_eval_reads_past_an_unreadable_checkpoint_and_moves_nothing(tmp_path):
  """An eval moved a damaged checkpoint aside (eval only reads), so the next training run, finding none,
  started again from step 0 without a word."""
  run = tmp_path / "run"
  loop.run(tiny_template(total_steps=4, **{"checkpoint.keep": 2}), str(run))
  _truncate_model_files(run, 4)
  assert loop.run(tiny_template(total_steps=4), str(run), "eval")  # the metrics of step 2
  assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
  _truncate_model_files(run, 2)
  with pytest.raises(RunError, match=r"no checkpoint in .* could be read \(step 4: .*; step 2: .*\); the unreadable "
                                     r"steps were left as they are$"):
    loop.run(tiny_template(total_steps=4), str(run), "eval")
  assert not (run / "corrupt_checkpoints").exists()
  with pytest.raises(RunError, match=r"moved to .*corrupt_checkpoints; run again to train from step 0$"):
    loop.run(tiny_template(total_steps=4), str(run))
  assert len(list((run / "corrupt_checkpoints").iterdir())) == 2
  loop.run(tiny_template(total_steps=4), str(run))  # from step 0, the earlier log kept aside
  assert (run / "metrics.jsonl.before_step_0").exists() and (run / "checkpoints" / "4").is_dir()


def test_eval_draws_its_figures_under_its_step_and_leaves_the_ones_training_drew(tmp_path, monkeypatch):
  """--mode=eval drew over the attention maps of training's last eval: comparing the two lost training's."""
  from xattn_jax.tasks.template import TemplateTask  # noqa: PLC0415
  from xattn_jax.training import inference  # noqa: PLC0415

  def extra_eval(self, model):
    if self.figure_directory:
      for path in task_lib.figure_family(str(pathlib.Path(self.figure_directory) / "plots"), "map_", 1):
        pathlib.Path(path).write_text(self.mode)
    return {}

  monkeypatch.setattr(TemplateTask, "extra_eval", extra_eval)
  run = tmp_path / "run"
  loop.run(tiny_template(), str(run))
  loop.run(tiny_template(), str(run), "eval")
  assert (run / "plots" / "map_0.png").read_text() == "train"
  assert (run / "eval_results" / "step_2" / "plots" / "map_0.png").read_text() == "eval"
  assert inference.load_model(str(run), mode="eval")[1].figure_directory == str(run / "eval_results" / "step_2")
  assert inference.load_model(str(run))[1].figure_directory is None  # infer draws no eval figures


@pytest.mark.parametrize("step", [-1, 2.0, True, "2"])
def test_an_eval_figure_directory_needs_a_checkpoint_step(step):
  with pytest.raises(ValueError, match=r"^eval_figure_directory: step must be a checkpoint's step, an int >= 0, got "):
    workdir.eval_figure_directory("run", step)


def test_a_run_moved_with_its_data_file_trains_on_reading_the_file_at_its_new_path(tmp_path):
  """A run and its data file copied elsewhere (shared storage, a colleague's machine) could not be trained on:
  its config.py names the file's old path, and naming the new one was refused as another data section. The same
  contents (data_files.json holds their SHA-256) at another path are the same data."""
  def with_file(path, **overrides):  # the template task reads no file: a data section as a task that reads one has
    config = tiny_template(**overrides)
    config.data = {"train_file": str(path)}
    return config

  (tmp_path / "pairs.tsv").write_text("a.png\ta cat\n")
  loop.run(with_file(tmp_path / "pairs.tsv"), str(tmp_path / "run"))
  (tmp_path / "shared").mkdir()
  (tmp_path / "run").rename(tmp_path / "shared" / "run")
  (tmp_path / "pairs.tsv").rename(tmp_path / "shared" / "pairs.tsv")
  moved = tmp_path / "shared" / "pairs.tsv"
  run = str(tmp_path / "shared" / "run")
  loop.run(with_file(moved, total_steps=4), run)
  assert json.loads((tmp_path / "shared" / "run" / workdir.DATA_RECORD).read_text())[
      "data.train_file"]["path"] == str(moved)  # a run depending on this one checks the file where it is now
  (tmp_path / "other.tsv").write_text("a.png\ta dog\n")
  with pytest.raises(validation.ConfigError, match=r"^config\.data\.train_file=.*other\.tsv.*was made with"):
    loop.run(with_file(tmp_path / "other.tsv", total_steps=6), run)  # other contents: another data section


def test_a_record_write_cut_short_leaves_the_record_it_replaces(tmp_path, monkeypatch):
  """config.json and data_files.json were rewritten in place: a process killed (or a disk filling) mid-write left
  an empty record, and every later start of the run ended in a JSONDecodeError traceback."""
  config = _config()
  workdir.write_config(config, str(tmp_path))
  workdir.record_data_files(config, str(tmp_path))
  before = {name: (tmp_path / name).read_text() for name in (*workdir.RECORD_FILES, workdir.DATA_RECORD)}
  real_open = open

  class DiskFull:
    def __init__(self, path, mode="r", *args, **kwargs):
      self.file = real_open(path, mode, *args, **kwargs)  # truncates what it opens for writing

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.file.close()

    def write(self, text):
      raise OSError(28, "No space left on device")

  monkeypatch.setattr(records, "open", DiskFull, raising=False)  # where workdir writes them through
  with pytest.raises(OSError):
    workdir.write_config(_config(total_steps=7), str(tmp_path))
  with pytest.raises(OSError):
    workdir.record_data_files(config, str(tmp_path))
  assert {name: (tmp_path / name).read_text() for name in before} == before


def _read_config(path):
  _with_checkpoint(path)
  workdir.check_same_model(_config(), str(path), "eval")


def _read_result_step(path):
  from xattn_jax.training import checkpoints  # noqa: PLC0415 - orbax only for this test
  _with_checkpoint(path)
  checkpoints.result_step(str(path))


def _read_frozen(path):
  from xattn_jax.tasks.vlm import frozen  # noqa: PLC0415 - the VLM only for this test
  frozen.dependencies(vlm_digits.get_config(), str(path))


def _read_encoder(path):
  from configs import qformer_digits  # noqa: PLC0415
  from xattn_jax.tasks.digits import qformer  # noqa: PLC0415 - the Q-Former only for this test
  qformer.QFormerTask.dependencies(qformer_digits.get_config(), str(path))


def _read_metrics(path):
  from xattn_jax.training import metrics  # noqa: PLC0415
  metrics.read_metrics(str(path / "metrics.jsonl"))


def _read_task_record(name, **overrides):
  def read(path):
    from xattn_jax.training import task  # noqa: PLC0415
    getattr(task, name)(_config(**overrides), str(path))
  return read


@pytest.mark.parametrize("name, text, position, read", [
    # cut off in place by a kill, as an older version wrote it
    ("config.json", '{\n  "checkpoint": {\n    "best_metric": "eval/lo', "3:20", _read_config),
    ("config.json", "", "1:1", _read_result_step),  # checkpoints.result_step: the step a frozen part is read at
    ("data_files.json", '{"data.train_file": {"path": "a.tsv",}}', "1:38",
     lambda path: workdir.changed_data_files(_config(), str(path))),
    ("end_step.json", '{"end_step": 40, "total_st', "1:18", _read_task_record("read_end_step", max_epochs=2.0)),
    ("early_stop.json", '["step", 4]\n', "1:1", _read_task_record("read_early_stop", **{"early_stopping.patience": 2})),
    ("frozen.json", '{"encoder_workdir": "/runs/enc" "lm_workdir": ""}', "1:33", _read_frozen),
    ("encoder.json", '{"encoder_workdir": /runs/vit}', "1:21", _read_encoder),
    # a whole damaged line is refused (a resume would rewrite the log without it); the last, cut by a kill, is not
    ("metrics.jsonl", '{"step": 1}\n{"step": 2, "train/loss": 0,5}\n{"step": 3}\n{"step": 4, "tr', "2:29",
     _read_metrics),
], ids=["config.json", "config.json-result_step", "data_files.json", "end_step.json", "early_stop.json", "frozen.json",
        "encoder.json", "metrics.jsonl"])
def test_a_damaged_record_is_refused_in_one_line_naming_file_and_position_and_left_as_it_is(
    tmp_path, name, text, position, read):
  """A record a run reads back, damaged, ends it in one line (launch.py: exit status 2) saying what to do."""
  (tmp_path / name).write_text(text)
  with pytest.raises(DataError) as error:
    read(tmp_path)
  message = str(error.value)
  assert message.startswith(f"{tmp_path / name}:{position}: a damaged record") and "\n" not in message
  assert any(remedy in message for remedy in ("backup", "move it aside", "delete that line"))
  assert (tmp_path / name).read_text() == text


def test_launch_names_a_damaged_config_record_in_one_line_with_exit_status_2(tmp_path):
  from tests import helpers  # noqa: PLC0415
  workdir.write_config(_config(), str(tmp_path))
  _with_checkpoint(tmp_path)
  cut = (tmp_path / "config.json").read_bytes()[:100]
  (tmp_path / "config.json").write_bytes(cut)
  result = helpers.launch("configs/template.py:size=tiny", tmp_path, "--mode=eval")
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith(f"launch.py: {tmp_path / 'config.json'}:") and result.stderr.count("\n") == 1
  assert (tmp_path / "config.json").read_bytes() == cut
