"""The ablation runner (experiments/ablate_positions.py) and its encoding plots (experiments/plot_encodings.py)."""
import json
import pathlib
import sys

import numpy as np
import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "experiments"))

import ablate_positions  # noqa: E402
import plot_encodings  # noqa: E402
from experiments import sweep  # noqa: E402
from tests.experiments import fake_launch  # noqa: E402
from xattn_jax.training import validation  # noqa: E402
from xattn_jax.ops import positions as positions_ops  # noqa: E402


def test_sinusoidal_dot_product_with_position_64_is_largest_at_64():
  table = np.asarray(positions_ops.sinusoidal(np.arange(129), 64))
  products = plot_encodings.dot_products(table, 64)
  assert np.argmax(products) == 64 and products[64] == pytest.approx(32.0, rel=1e-5)  # 32 (sin, cos) pairs


def test_dot_products_reject_an_anchor_outside_the_table():
  with pytest.raises(ValueError, match="row 64"):
    plot_encodings.dot_products(np.zeros((33, 8)), 64)


def test_rope_score_of_identical_query_and_key_peaks_at_offset_zero():
  offsets = np.arange(-64, 65)
  scores = plot_encodings.rope_scores(offsets)
  assert offsets[np.argmax(scores)] == 0


def test_linear_rope_scaling_stretches_the_score_curve_by_its_factor():
  offsets = np.arange(-20, 21)
  np.testing.assert_allclose(plot_encodings.rope_scores(4 * offsets, scaling="linear", scaling_factor=4.0),
                             plot_encodings.rope_scores(offsets), rtol=1e-4, atol=1e-3)


def test_plot_encodings_runs_alone_with_a_help_and_writes_its_two_pictures(tmp_path, capsys):
  """`python experiments/plot_encodings.py --help` printed nothing."""
  with pytest.raises(SystemExit) as shown:
    plot_encodings.main(["--help"])
  assert shown.value.code == 0 and "Pictures of the sequence position encodings" in capsys.readouterr().out
  assert plot_encodings.main(["--out", str(tmp_path), "--max_offset", "16"]) == 0
  for name in ("dot_products", "rope_scores"):
    assert (tmp_path / f"encoding_{name}.png").stat().st_size > 1000


def test_plot_encodings_expands_a_home_out_and_refuses_one_under_a_file(tmp_path, monkeypatch, capsys):
  """`--out=~/pictures` wrote into a folder named `~` in the current one; `--out=notes.txt/pictures` was a traceback."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  assert plot_encodings.main(["--out=~/pictures", "--max_offset=4"]) == 0
  assert (tmp_path / "home" / "pictures" / "encoding_rope_scores.png").exists() and not (tmp_path / "~").exists()
  (tmp_path / "notes.txt").write_text("mine\n")
  with pytest.raises(SystemExit) as refused:
    plot_encodings.main(["--out=notes.txt/pictures"])
  assert refused.value.code == 2 and f"lies under the file {tmp_path}/notes.txt" in capsys.readouterr().err


@pytest.mark.parametrize("factor", ["nan", "inf"])
def test_plot_encodings_refuses_a_scaling_factor_that_is_not_a_finite_positive_number(tmp_path, capsys, factor):
  """nan was a traceback from rope_angles; inf drew empty curves."""
  with pytest.raises(SystemExit) as refused:
    plot_encodings.main(["--out", str(tmp_path), f"--scaling_factor={factor}"])
  assert refused.value.code == 2 and f"--scaling_factor={factor}" in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


def test_summary_is_mean_and_sample_std_over_the_seeds_that_finished():
  keys = [key for key, _ in ablate_positions.EXPERIMENTS[1].metrics]
  runs = [{key: value for key in keys} for value in (0.2, 0.4, 0.9)]
  summary = ablate_positions.summarize({("length", "alibi"): runs})
  cell = summary["length"]["alibi"][keys[0]]
  assert cell["seeds"] == 3 and cell["mean"] == pytest.approx(0.5) and cell["std"] == pytest.approx(np.std([.2, .4, .9],
                                                                                                          ddof=1))
  assert set(summary) == {"length"} and set(summary["length"]) == {"alibi"}


def test_markdown_has_one_row_per_finished_encoding_with_its_seed_count():
  keys = [key for key, _ in ablate_positions.EXPERIMENTS[0].metrics]
  results = {("dates", "rope"): [dict.fromkeys(keys, 1.0)], ("dates", "none"): [dict.fromkeys(keys, 0.5)] * 2}
  text = ablate_positions.markdown(ablate_positions.summarize(results), ["a note"])
  columns = len(keys)
  assert "| none |" + " 0.500 ± 0.000 |" * columns + " 2 |" in text
  assert "| rope |" + " 1.000 ± 0.000 |" * columns + " 1 |" in text
  assert "## length" not in text and text.rstrip().endswith("a note")


def test_every_cell_has_its_own_workdir_and_seed():
  todo = ablate_positions.cells(quick=False, seeds=2, only=set())
  encodings = sum(len(experiment.encodings) for experiment in ablate_positions.EXPERIMENTS)
  assert len({cell.workdir(pathlib.Path("/w")) for cell in todo}) == len(todo) == 2 * encodings
  assert all(f"--config.seed={cell.seed}" in cell.command(pathlib.Path("/w"), False) for cell in todo)


def test_quick_ablation_writes_table_and_plots_and_skips_finished_cells(tmp_path, monkeypatch, capsys):
  # Each cell's launch.py is a stand-in that writes a finished run's record (fake_launch): the runner's own work
  # is tested here, the training of these configs with launch.py itself.
  launch = fake_launch.FakeLaunch(key for experiment in ablate_positions.EXPERIMENTS for key, _ in experiment.metrics)
  monkeypatch.setattr(ablate_positions.sweep, "subprocess", launch)
  argv = ["--quick", f"--workdir={tmp_path / 'work'}", f"--results={tmp_path / 'results'}"]
  assert ablate_positions.main(argv) == 0, capsys.readouterr().out
  capsys.readouterr()
  summary = json.loads((tmp_path / "results" / "ablation_positions.json").read_text())
  assert set(summary) == {"dates", "length", "resolution", "provenance"}
  assert summary["length"]["learned"]["eval/exact_match_1_32"] == {"mean": 0.5, "std": 0.0, "seeds": 1}
  assert summary["provenance"]["command"].startswith("python experiments/ablate_positions.py --quick")
  assert "- command: `python experiments/ablate_positions.py --quick" in (
      tmp_path / "results" / "ablation_positions.md").read_text()
  for name in ("length_bands", "resolution", "dot_products", "rope_scores"):
    assert (tmp_path / "results" / f"ablation_{name}.png").stat().st_size > 1000
  result = json.loads((tmp_path / "work" / "quick" / "dates" / "rope" / "seed0" / "result.json").read_text())
  assert result["commit"] == ablate_positions.sweep.head_commit() and "--config.seed=0" in result["settings"]
  assert ablate_positions.main(argv) == 0
  second = capsys.readouterr().out
  assert second.count("done before") == 3 and len(launch.commands) == 3, second


def test_an_only_run_keeps_the_other_experiments_and_every_finished_seed_in_the_tables(tmp_path, monkeypatch,
                                                                                       capsys):
  """--only=length rewrote the tables with the length experiment alone, and fewer --seeds hid finished seeds."""
  monkeypatch.setattr(ablate_positions.sweep, "subprocess", fake_launch.FakeLaunch(
      key for experiment in ablate_positions.EXPERIMENTS for key, _ in experiment.metrics))
  argv = ["--quick", f"--workdir={tmp_path / 'work'}", f"--results={tmp_path / 'results'}"]
  assert ablate_positions.main(argv) == 0
  dates = ablate_positions.EXPERIMENTS[0]
  extra = ablate_positions.Cell(dates, "rope", 1)  # a second seed, finished earlier
  assert ablate_positions.run_cell(extra, tmp_path / "work" / "quick", quick=True, single_thread=True)[1] is not None
  cut_short = ablate_positions.Cell(dates, "rope", 2).workdir(tmp_path / "work" / "quick") / "result.json"
  cut_short.parent.mkdir(parents=True)
  cut_short.write_text('{"eval/exact_match": 0.')  # a seed not launched now, its result cut short: named, not hidden
  capsys.readouterr()
  assert ablate_positions.main([*argv, "--only=length"]) == 0
  summary = json.loads((tmp_path / "results" / "ablation_positions.json").read_text())
  assert set(summary) == {"dates", "length", "resolution", "provenance"}
  assert summary["dates"]["rope"]["eval/exact_match"]["seeds"] == 2
  said = capsys.readouterr().out
  assert "dates (2 cells, seeds 0, 1); resolution (1 cell, seeds 0)" in said
  warning = f"WARNING: a cell this run did not launch is left out of the tables: {cut_short}:1: not valid JSON"
  assert warning in said and warning in (tmp_path / "results" / "ablation_positions.md").read_text()
  assert "dates (2 cells, seeds 0, 1)" in (tmp_path / "results" / "ablation_positions.md").read_text()


def test_the_dot_product_plot_leaves_out_a_stale_learned_table_as_the_tables_leave_out_its_row(tmp_path, monkeypatch,
                                                                                              capsys):
  """A learned length cell trained under other settings was left out of the tables but drawn as the trained table."""
  monkeypatch.setattr(ablate_positions.sweep, "subprocess", fake_launch.FakeLaunch(
      key for experiment in ablate_positions.EXPERIMENTS for key, _ in experiment.metrics))
  argv = ["--quick", "--only=length", f"--workdir={tmp_path / 'work'}", f"--results={tmp_path / 'results'}"]
  assert ablate_positions.main(argv) == 0
  result_path = tmp_path / "work" / "quick" / "length" / "learned" / "seed0" / "result.json"
  result = json.loads(result_path.read_text())
  result_path.write_text(json.dumps({**result, "settings": result["settings"] + ["--config.total_steps=9"]}))
  read = []
  monkeypatch.setattr(ablate_positions, "learned_table", read.append)
  assert ablate_positions.main(argv) == 1 and "STALE" in capsys.readouterr().out
  assert read == [] and "length" not in json.loads((tmp_path / "results" / "ablation_positions.json").read_text())


def test_a_repeated_only_adds_its_experiments_as_length_generalizations_does(tmp_path, monkeypatch, capsys):
  """`--only=dates --only=length` ran the length cells alone: the second flag replaced the first."""
  launch = fake_launch.FakeLaunch(key for experiment in ablate_positions.EXPERIMENTS for key, _ in experiment.metrics)
  monkeypatch.setattr(ablate_positions.sweep, "subprocess", launch)
  assert ablate_positions.main(["--quick", "--only=dates", "--only=length", f"--workdir={tmp_path / 'work'}",
                                f"--results={tmp_path / 'results'}"]) == 0
  said = capsys.readouterr().out
  assert "dates/rope/seed0" in said and "length/learned/seed0" in said and "resolution" not in said


def test_every_quick_cell_resolves_to_a_valid_config():
  """What --quick launches parses and validates as launch.py would, before any training (which the fake skips)."""
  for cell in ablate_positions.cells(quick=True, seeds=1, only=set()):
    validation.validate_config(sweep.resolved_config(cell.command(pathlib.Path("/w"), quick=True)))


def test_the_learned_table_is_read_from_a_translators_checkpoint(tmp_path):
  """The dot-product plot's learned panel: the runner's test launches no training (fake_launch), so the table is
  read here from a checkpoint of a real Translator's state, saved as training saves it; a save a kill cut short
  beside it was a ValueError (int() of its name) after the whole sweep."""
  from flax import nnx
  from xattn_jax.models import translator
  from xattn_jax.training import checkpoints
  size = translator.StackSize(d_model=8, num_heads=2, num_layers=1, mlp_dim=16)
  model = translator.Translator(11, encoder=size, decoder=size, position_encoding="learned", max_length=20,
                                rngs=nnx.Rngs(0))
  stored = checkpoints.Checkpoints(str(tmp_path), keep=2, best_metric="eval/loss", best_mode="min")
  stored.save(6, nnx.to_pure_dict(nnx.state(model)), {"count": np.zeros((), np.int32)}, {"step": 6})
  stored.close()
  (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-1733600000").mkdir()  # a later save cut short by a kill
  np.testing.assert_array_equal(ablate_positions.learned_table(tmp_path), model.target_positions.table[...])
  assert ablate_positions.learned_table(tmp_path / "none") is None
