"""compare_connectors: the cost rows (what a connector hands the LM, and what it costs, as the image grows),
the test split scored after training on validation, and the probe's encoder."""
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import compare_connectors
from xattn_jax.data import vlm_digits
from xattn_jax.models import connectors
from xattn_jax.tasks.vlm import probe
from xattn_jax.training import inference
from tests import helpers
from tests.tasks.test_vlm import TINY_CHAIN, tiny_chain


@pytest.mark.slow
def test_cost_rows_count_what_an_image_hands_the_lm_at_each_scale():
  chain = tiny_chain()  # its encoder: 4 x 4 patches, strips of up to 2 digits
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm"}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=llava",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  rows = compare_connectors._cost(config, scales=(1, 2), digits=1)
  assert [(r["scale"], r["digits"]) for r in rows] == [(1, 1), (2, 1)]
  for r in rows:
    patches = 4 * r["digits"] * r["scale"] ** 2  # (8 s / 4)^2 patches a digit
    assert r["M"] == patches + 1 and r["tokens_to_lm"] == patches + 1  # llava: a token a patch, then the marker
    assert r["forward_ms"] > 0 and r["train_step_ms"] > 0 and r["cached_step_ms"] > 0
  # the connector's own 2D position table is sized to the grid; nothing else in it grows with the image
  assert rows[1]["trainable_parameters"] > rows[0]["trainable_parameters"]


def test_the_default_comparison_is_every_connector_the_model_has():
  """The script names its default list before importing JAX (--help stays fast): the model's registry owns it."""
  assert compare_connectors.CONNECTORS == tuple(connectors.CONNECTORS)


def test_a_scale_inside_a_connector_is_refused_for_one_encoder_and_probe_a_comparison(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    compare_connectors.main(["--connectors", "qformer,llava/scale=2", "--out", str(tmp_path)])
  assert exit_info.value.code == 2 and "--scale" in capsys.readouterr().err
  assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_a_bad_connector_or_seed_is_one_line_before_anything_trains_and_cost_rows_train_nothing(tmp_path, capsys,
                                                                                                 monkeypatch):
  """--connectors bogus trained the frozen parts for minutes first; --cost_only ('no training') trained them too."""
  from xattn_jax.training import dependencies
  monkeypatch.setattr(dependencies, "resolve", lambda *a, **k: pytest.fail("the frozen parts were resolved"))
  for argv, said in ((["--connectors", "bogus"], "--connectors bogus: config.model.connector='bogus'"),
                     (["--seeds", "0,a"], "--seeds / --scales: comma-separated integers")):
    with pytest.raises(SystemExit) as exit_:
      compare_connectors.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and said in capsys.readouterr().err
  row = {"digits": 1, "M": 17, "tokens_to_lm": 33, "trainable_parameters": 9, "forward_ms": 1.0, "train_step_ms": 2.0}
  monkeypatch.setattr(compare_connectors, "_cost", lambda config, scales: [{"scale": s, **row} for s in scales])
  compare_connectors.main(["--cost_only", "--scales", "1", "--connectors", "qformer", "--out", str(tmp_path)])
  assert (tmp_path / "vlm_cost_by_scale.json").is_file()


@pytest.mark.parametrize("argv, said", [
    (["--seeds", "0,0"], "--seeds=0,0: names a value twice"),
    (["--connectors", "llava,llava"], "--connectors=llava,llava: names a value twice"),
    (["--scales", "0"], "--scales=0: image scales must be integers >= 1"),
    (["--probe_steps", "-1"], "--probe_steps=-1: must be >= 1"),
    # a thousand seeds queued three thousand trainings; a bad seed after the first failed once the others trained
    (["--seeds", ",".join(map(str, range(1000)))], "1000 seeds; allowed are 1 to 20"),
    (["--seeds", "0,-1"], "--seeds=0,-1: each seed must be a non-negative integer below 2**32")])
def test_a_repeated_seed_or_connector_a_scale_or_probe_below_one_is_one_line_before_anything_trains(
    tmp_path, capsys, monkeypatch, argv, said):
  """Each trained the frozen parts first: a repeated seed then counted twice in the mean, the others failed after."""
  from xattn_jax.training import dependencies
  monkeypatch.setattr(dependencies, "resolve", lambda *a, **k: pytest.fail("the frozen parts were resolved"))
  with pytest.raises(SystemExit) as exit_:
    compare_connectors.main([*argv, "--out", str(tmp_path)])
  assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_quick_names_each_flag_set_by_the_user_that_it_overrides(tmp_path, capsys, monkeypatch):
  """--quick silently ignored --seeds / --steps / --workdirs / --encoder / --lm."""
  from xattn_jax.training import dependencies

  class Stop(Exception):
    pass

  def stop(*args, **kwargs):
    raise Stop
  monkeypatch.setattr(dependencies, "resolve", stop)  # before the frozen parts train
  with pytest.raises(Stop):
    compare_connectors.main(["--quick", "--seeds", "4", "--steps", "7", "--lm", "mine", "--connectors", "llava",
                             "--out", str(tmp_path)])
  said = capsys.readouterr().out
  assert "--quick sets its own tiny chain, seed and budget: --seeds=4 --steps=7 --lm=mine not used" in said


def test_a_finished_run_evaluated_on_another_number_of_test_examples_cannot_join(tmp_path):
  run = tmp_path / "qformer_seed0"
  assert compare_connectors.other_test_set(str(run), 2000) == ""  # not trained yet: it trains with this config
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"data": {"num_eval_examples": 256}}))
  (run / "wall_seconds.json").write_text("12.5")
  assert compare_connectors.other_test_set(str(run), 256) == ""
  assert "answered 256 test examples, not 2000" in compare_connectors.other_test_set(str(run), 2000)


def test_a_finished_run_of_another_budget_cannot_join_under_this_ones_name(tmp_path):
  """The flamingo runs of 14,000 steps were reported as 12,000 once that became its default."""
  from configs import vlm_digits as vlm_digits_config
  config = vlm_digits_config.get_config("connector=flamingo")
  config.data.num_eval_examples = 2000
  run = tmp_path / "flamingo_seed0"
  assert compare_connectors.other_run(str(run), config) == ""  # not trained yet
  run.mkdir()
  recorded = json.loads(config.to_json_best_effort())
  del recorded["task"]["describe_first"]  # a run older than a field is compared on the fields it holds
  recorded["data"]["num_eval_examples"] = 256  # other_test_set's to name
  (run / "config.json").write_text(json.dumps(recorded))
  assert compare_connectors.other_run(str(run), config) == ""
  recorded["total_steps"] = config.total_steps + 2000
  (run / "config.json").write_text(json.dumps(recorded))
  assert (f"trained with total_steps={config.total_steps + 2000}, this comparison's config has {config.total_steps}"
          in compare_connectors.other_run(str(run), config))


@pytest.mark.slow
def test_a_run_evaluates_on_validation_and_is_scored_on_test_once_it_finished(tmp_path):
  run = tmp_path / "vlm"
  shutil.copytree(tiny_chain() / "vlm", run)  # the chain's folder stays as built
  _, task = inference.load_model(str(run), "eval")
  config = task.config
  assert config.data.eval_split == "validation"
  def examples(split):
    return vlm_digits.make_examples(split, config.data.num_eval_examples, config.data.eval_seed,
                                    max_digits=config.data.max_digits, kinds=("count",))
  assert [e.digits for e in task.eval_examples] == [e.digits for e in examples("validation")]
  metrics = compare_connectors.test_metrics(str(run))
  _, test_task = inference.load_model(str(run), "eval", overrides={"data.eval_split": "test"})
  assert [e.digits for e in test_task.eval_examples] == [e.digits for e in examples("test")]
  assert [e.digits for e in examples("test")] != [e.digits for e in examples("validation")]
  assert 0.0 <= metrics["eval/exact_match"] <= 1.0 and metrics["eval/loss"] > 0
  # kept: a comparison measuring the run again reads the file, and the run's eval record holds the test eval
  assert json.loads((run / "test_metrics.json").read_text()) == metrics
  assert compare_connectors.test_metrics(str(run)) == metrics
  # answered in two passes (task.describe_first): kept apart, the default's file untouched
  described = compare_connectors.test_metrics(str(run), describe_first=True)
  assert 0.0 <= described["eval/exact_match"] <= 1.0
  assert json.loads((run / "test_metrics_describe_first.json").read_text()) == described
  assert json.loads((run / "test_metrics.json").read_text()) == metrics


@pytest.mark.slow
def test_the_probe_reads_the_encoder_weights_the_vlm_freezes():
  encoder_workdir = tiny_chain() / "encoder"
  loaded = probe.load_encoder(str(encoder_workdir))
  model, _ = inference.load_model(str(encoder_workdir), "infer")
  expected, got = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
  assert jax.tree.structure(expected) == jax.tree.structure(got)
  jax.tree.map(np.testing.assert_array_equal, expected, got)
