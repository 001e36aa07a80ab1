"""vlm_errors: a trained run's eval split by question kind and digit count, agreeing with the run's own eval."""
import json

import pytest

from experiments import vlm_errors
from tests import helpers
from tests.tasks.test_vlm import tiny_chain


def test_the_table_counts_each_target_once_under_its_kind_and_largest_image():
  rows = [("sum", 2, "nine", "nine"), ("sum", 2, "nine", "eight"), ("larger", 1, "first", "first"),
          ("sum", 4, "twelve", "twelve")]
  assert vlm_errors.table(rows) == {"larger": {"1": [1, 1]}, "sum": {"2": [1, 2], "4": [1, 1]}}


@pytest.mark.slow
def test_a_trained_runs_cells_add_up_to_its_own_eval_exact_match(tmp_path):
  run = tiny_chain() / "vlm"
  vlm_errors.main(["--workdir", str(run), "--out", str(tmp_path), "--wrong", "3"])
  [record] = json.loads((tmp_path / "vlm_errors.json").read_text())["runs"]
  cells = [cell for by in record["table"].values() for cell in by.values()]
  right, targets = sum(c[0] for c in cells), sum(c[1] for c in cells)
  final = helpers.metric_rows(run)[-1]
  assert set(record["table"]) == {"count"}  # the chain trains and evaluates the count question only
  assert right / targets == pytest.approx(final["eval/exact_match"])
  assert len(record["wrong"]) == min(3, targets - right)
  assert all(reference != answer for _, _, reference, answer in record["wrong"])
  assert "| count |" in (tmp_path / "vlm_errors.md").read_text()


@pytest.mark.slow
def test_more_eval_examples_than_the_run_evaluated_are_answered_on_request(tmp_path):
  run = tiny_chain() / "vlm"  # evaluated on 16 count questions, one target each
  vlm_errors.main(["--workdir", str(run), "--out", str(tmp_path), "--eval_examples", "40"])
  [record] = json.loads((tmp_path / "vlm_errors.json").read_text())["runs"]
  assert sum(cell[1] for by in record["table"].values() for cell in by.values()) == 40
