"""The length-generalization runner (experiments/length_generalization.py)."""
import importlib
import json
import pathlib
import sys

import numpy as np
import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "experiments"))

import length_generalization as lg  # noqa: E402
from experiments import bench_common, sweep  # noqa: E402
from tests.experiments import fake_launch  # noqa: E402
from xattn_jax.layers import positions as position_layers  # noqa: E402
from xattn_jax.training import validation  # noqa: E402

ROOT = pathlib.Path("/w")
META = {"commit": "abc123", "date": "2026-12-01 21:00 UTC", "load_average": [0.5, 0.4, 0.3],
        "command": "python experiments/length_generalization.py --seeds=2"}


def _result(value):
  return dict.fromkeys(lg.METRICS, value)


def test_grid_is_tasks_times_plain_and_randomized_variants_times_seeds():
  todo = lg.cells(quick=False, seeds=3)
  assert len(todo) == len(lg.TASKS) * (len(lg.ENCODINGS) + len(lg.RANDOMIZED_ENCODINGS)) * 3
  assert len({cell.workdir(ROOT) for cell in todo}) == len(todo)


def test_the_grid_is_every_registered_sequence_encoding_and_randomizes_those_the_registry_lets():
  assert lg.ENCODINGS == position_layers.names(layout="sequence")
  assert set(lg.RANDOMIZED_ENCODINGS) <= set(position_layers.names(layout="sequence", randomizable=True))


def test_an_encoding_the_registry_does_not_randomize_gets_no_randomized_cell():
  # An entry of the registry when the runner is imported, as one added to POSITION_ENCODINGS is; launch.py refuses
  # randomized_positions_max for it, so a "+randomized" cell would only fail.
  entry = position_layers.PositionEncoding(lambda o, rngs: position_layers.NoPositions(), ("sequence",), "additive")
  position_layers.register_position_encoding("fixed_only", entry)
  try:
    runner = importlib.reload(lg)
    assert ("fixed_only", False) in runner.variants() and ("fixed_only", True) not in runner.variants()
    assert ("rope", True) in runner.variants() and ("none", True) not in runner.variants()
  finally:
    position_layers.POSITION_ENCODINGS.pop("fixed_only")
    importlib.reload(lg)


def test_nope_has_no_randomized_cell():
  assert not [cell for cell in lg.cells(quick=False, seeds=1) if cell.encoding == "none" and cell.randomized]


def test_only_randomized_cells_pass_randomized_positions_max():
  for cell in lg.cells(quick=False, seeds=1):
    passed = f"--config.model.randomized_positions_max={lg.RANDOMIZED_MAX}" in cell.command(ROOT, quick=False)
    assert passed == cell.randomized


def test_each_cell_command_names_its_task_encoding_seed_and_workdir():
  cell = lg.Cell("sort", "alibi", True, 2)
  command = cell.command(ROOT, quick=False)
  assert any(a.endswith(f"{lg.CONFIG}:operation=sort,posenc=alibi,size={lg.SIZE}") for a in command)
  assert "--config.seed=2" in command and f"--workdir={ROOT / 'sort' / 'alibi+randomized' / 'seed2'}" in command


def test_randomized_max_covers_the_longest_eval_row_of_every_task():
  from configs import lm_algorithmic
  assert all(lm_algorithmic.get_config(f"operation={task}").model.max_length <= lg.RANDOMIZED_MAX
             for task in lg.TASKS)


def test_only_keeps_the_named_tasks_and_encodings():
  todo = lg.cells(quick=False, seeds=2, only={"copy", "reverse", "rope"})
  variants = ("rope", "rope+randomized")
  assert {(c.task, c.variant) for c in todo} == {(t, v) for t in ("copy", "reverse") for v in variants}
  assert len(todo) == 8


def test_only_refuses_an_unknown_name():
  with pytest.raises(ValueError, match="unknown names"):
    lg.cells(quick=False, seeds=1, only={"copy", "ropes"})


def test_an_only_that_selects_no_cell_is_refused_before_anything_runs(tmp_path, capsys):
  """--quick --only=alibi,sort ran 0/0 cells and wrote an empty table and plot with status 0."""
  with pytest.raises(SystemExit) as stopped:
    lg.main(["--quick", "--only=alibi,sort", f"--workdir={tmp_path / 'w'}", f"--results={tmp_path / 'r'}"])
  assert stopped.value.code == 2 and "--only=alibi,sort selects none of the --quick cells (copy/rope)" in \
      capsys.readouterr().err
  assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


def test_without_randomized_support_no_randomized_cell_is_made():
  assert not any(cell.randomized for cell in lg.cells(quick=False, seeds=1, randomized=False))
  assert [c for c in lg.cells(quick=True, seeds=1, randomized=False)] == [lg.Cell("copy", "rope", False, 0)]


def test_a_cell_with_a_result_is_not_run_again(tmp_path):
  cell = lg.Cell("copy", "rope", False, 0)
  workdir = cell.workdir(tmp_path)
  workdir.mkdir(parents=True)
  (workdir / "result.json").write_text(json.dumps(_result(0.25)))
  _, metrics, message = lg.run_cell(cell, tmp_path, quick=True, single_thread=True)
  assert message == "done before" and metrics == _result(0.25)
  assert not (workdir / "log.txt").exists()


def test_finished_results_collect_only_cells_with_a_result(tmp_path):
  done, pending = lg.Cell("copy", "alibi", True, 0), lg.Cell("copy", "alibi", True, 1)
  done.workdir(tmp_path).mkdir(parents=True)
  (done.workdir(tmp_path) / "result.json").write_text(json.dumps(_result(1.0)))
  assert sweep.finished_cells([done, pending], tmp_path, quick=True) == [(done, _result(1.0))]


def test_summary_is_mean_and_sample_std_over_the_seeds_that_finished():
  summary = lg.summarize({("reverse", "t5_bias"): [_result(v) for v in (0.2, 0.4, 0.9)]})
  cell = summary["reverse"]["t5_bias"]["eval/exact_match_21_40"]
  assert cell["seeds"] == 3 and cell["mean"] == pytest.approx(0.5)
  assert cell["std"] == pytest.approx(np.std([0.2, 0.4, 0.9], ddof=1))
  assert set(summary) == {"reverse"} and set(summary["reverse"]) == {"t5_bias"}


def test_markdown_has_a_row_per_variant_with_its_seed_count_and_the_budget():
  results = {("copy", "rope"): [_result(1.0)], ("copy", "rope+randomized"): [_result(0.5)] * 2}
  text = lg.markdown(lg.summarize(results), META, ["a note"])
  assert "| rope | no |" + " 1.000 ± 0.000 |" * len(lg.BANDS) + " 1 |" in text
  assert "| rope | yes |" + " 0.500 ± 0.000 |" * len(lg.BANDS) + " 2 |" in text
  assert "## reverse" not in text and f"{lg.TOTAL_STEPS} steps" in text and "a note" in text


def test_markdown_records_commit_date_load_and_command():
  text = lg.markdown({}, META, [])
  assert all(str(META[key]) in text for key in ("commit", "date", "load_average", "command"))


def test_markdown_names_the_sources_of_the_papers_numbers():
  text = lg.markdown({}, META, [])
  assert "results/sanity_check.jsonl" in text and "McGill-NLP/length-generalization" in text
  assert "google-deepmind/randomized_positional_encodings" in text


def test_outputs_are_a_table_a_json_summary_and_a_plot(tmp_path):
  summary = lg.summarize({("duplicate", "none"): [_result(0.3)], ("duplicate", "learned+randomized"): [_result(0.6)]})
  lg.write_outputs(summary, META, tmp_path, ["a note"])
  document = json.loads((tmp_path / "length_generalization.json").read_text())
  assert document["meta"] == META and set(document["summary"]["duplicate"]) == {"none", "learned+randomized"}
  assert (tmp_path / "length_generalization.png").stat().st_size > 1000
  assert "## duplicate" in (tmp_path / "length_generalization.md").read_text()


def test_quick_run_launches_its_cells_and_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
  # Each cell's launch.py is a stand-in that writes a finished run's record (fake_launch): the runner's own work
  # is tested here, the training of these configs with launch.py itself.
  launch = fake_launch.FakeLaunch(lg.METRICS)
  monkeypatch.setattr(lg.sweep, "subprocess", launch)
  status = lg.main(["--quick", f"--workdir={tmp_path / 'work'}", f"--results={tmp_path / 'results'}"])
  assert status == 0, capsys.readouterr().out
  document = json.loads((tmp_path / "results" / "length_generalization.json").read_text())
  assert document["summary"]["copy"]["rope+randomized"]["eval/exact_match_41_80"] == {"mean": 0.5, "std": 0.0,
                                                                                      "seeds": 1}
  assert len(launch.commands) == 2 and (tmp_path / "work" / "quick" / "copy" / "rope" / "seed0" / "result.json").exists()
  assert (tmp_path / "results" / "length_generalization.png").stat().st_size > 1000


def test_the_table_counts_every_finished_seed_on_disk_not_only_the_seeds_asked_for(tmp_path, monkeypatch, capsys):
  """--seeds=1 after 3 finished seeds showed n = 1: the table narrowed to the seeds asked for."""
  monkeypatch.setattr(lg.sweep, "subprocess", fake_launch.FakeLaunch(lg.METRICS))
  root = tmp_path / "work" / "quick"
  for seed in (1, 2):  # two more seeds of the plain cell, finished earlier (--quick itself runs seed 0)
    assert lg.run_cell(lg.Cell("copy", "rope", False, seed), root, quick=True, single_thread=True)[1] is not None
  argv = ["--quick", f"--workdir={tmp_path / 'work'}", f"--results={tmp_path / 'results'}"]
  assert lg.main(argv) == 0
  summary = json.loads((tmp_path / "results" / "length_generalization.json").read_text())["summary"]["copy"]
  assert summary["rope"]["eval/exact_match_1_20"]["seeds"] == 3
  assert summary["rope+randomized"]["eval/exact_match_1_20"]["seeds"] == 1
  said = capsys.readouterr().out
  assert "the tables also count finished cells this run did not launch" in said and "copy (2 cells, seeds 1, 2)" in said
  assert "copy (2 cells, seeds 1, 2)" in (tmp_path / "results" / "length_generalization.md").read_text()


def test_every_quick_cell_resolves_to_a_valid_config():
  """What --quick launches parses and validates as launch.py would, before any training (which the fake skips)."""
  for cell in lg.cells(quick=True, seeds=1):
    validation.validate_config(lg.sweep.resolved_config(cell.command(ROOT, quick=True)))


def test_run_metadata_marks_local_changes_as_every_results_file_does(monkeypatch):
  # it ran its own `git status`, which counted the tables a resumed run had just written as local changes
  record = {"commit": "0123456789abcdef", "dirty": True, "date": "2026-12-04 19:00 UTC", "command": "python x"}
  seen = []
  monkeypatch.setattr(bench_common, "provenance", lambda argv: seen.append(argv) or record)
  meta = lg.run_metadata(["--quick"])
  assert meta["commit"] == "0123456789abcdef+changes" and meta["date"] == record["date"]
  assert seen == [["experiments/length_generalization.py", "--quick"]] and len(meta["load_average"]) == 3
