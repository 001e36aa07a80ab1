"""Helpers of the Task contract that tasks share: the numbered figure families their evals draw."""
import pytest

from xattn_jax.training import task as task_lib


def test_a_figure_family_drawn_with_a_lower_count_leaves_none_of_the_earlier_higher_numbered_files(tmp_path):
  """A run evaluated again with fewer plots kept the earlier eval's higher-numbered PNGs, which looked current."""
  for name in ("validation_0.png", "validation_1.png", "validation_2.png", "validation_10.png"):
    (tmp_path / name).write_bytes(b"earlier eval")
  paths = task_lib.figure_family(str(tmp_path), "validation_", 1)
  assert paths == [str(tmp_path / "validation_0.png")]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["validation_0.png"]  # drawn over by the caller


def test_a_figure_family_removes_only_files_of_its_own_names(tmp_path):
  kept = ["test_3.png", "validation_03.png", "validation_3.png.txt", "my_validation_3.png", "validation_x.png",
          "validation_3.jpg"]
  for name in kept:
    (tmp_path / name).write_bytes(b"not this family's")
  (tmp_path / "validation_3").mkdir()  # a folder of that form is no figure
  (tmp_path / "validation_3.png").write_bytes(b"earlier eval")
  assert task_lib.figure_family(str(tmp_path), "validation_", 0) == []
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["validation_3"])


def test_a_figure_family_of_no_figures_makes_no_folder_and_of_some_makes_it(tmp_path):
  assert task_lib.figure_family(str(tmp_path / "plots"), "cross_attention_", 0) == []
  assert not (tmp_path / "plots").exists()
  assert task_lib.figure_family(str(tmp_path / "plots"), "cross_attention_", 2) == [
      str(tmp_path / "plots" / "cross_attention_0.png"), str(tmp_path / "plots" / "cross_attention_1.png")]
  assert (tmp_path / "plots").is_dir()


@pytest.mark.parametrize("arguments, message", [
    (dict(count=-1), r"^figure_family: count must be an int >= 0, got -1$"),
    (dict(count=1.0), r"^figure_family: count must be an int >= 0, got 1\.0$"),
    (dict(count=True), r"^figure_family: count must be an int >= 0, got True$"),
    (dict(count=1, prefix="maps/validation_"), r"^figure_family: prefix must be a file name's part, without '/', "
                                               r"got 'maps/validation_'$"),
])
def test_a_figure_family_refuses_a_bad_count_or_a_name_part_holding_a_folder(tmp_path, arguments, message):
  arguments = {"prefix": "validation_", **arguments}
  with pytest.raises(ValueError, match=message):
    task_lib.figure_family(str(tmp_path), arguments.pop("prefix"), **arguments)
