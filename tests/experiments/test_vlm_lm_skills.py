"""vlm_lm_skills: the frozen LM's answers from text alone, as the connectors' LM sees the text and described."""
import json

import pytest

from experiments import vlm_lm_skills
from tests.tasks.test_vlm import tiny_chain
from xattn_jax.data import vlm_digits


def test_prompts_end_before_the_last_target_in_both_forms():
  examples = vlm_digits.make_examples("test", 60, seed=0)
  for example in examples:
    for form, text in (("marker only", vlm_digits.text_of(example)),
                       ("described", vlm_digits.described_text_of(example))):
      prompt, answer = vlm_lm_skills.prompts_and_answers(example, form)
      assert f"{prompt} {answer}" == text and answer == example.targets()[-1]
  larger = next(e for e in examples if e.kind == "larger")
  prompt, _ = vlm_lm_skills.prompts_and_answers(larger, "described")
  assert prompt.endswith(f"{vlm_digits.digit_words(larger.digits[1])} which is larger ?")


@pytest.mark.slow
def test_scores_every_kind_and_digit_count_in_both_forms(tmp_path):
  lm = tiny_chain() / "lm"
  vlm_lm_skills.main(["--lm", str(lm), "--examples", "40", "--eval_from", "latest", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "vlm_lm_skills.json").read_text())
  examples = vlm_digits.make_examples("validation", 40, seed=0)  # the default split: what an LM is chosen by
  assert record["split"] == "validation"
  [run] = record["runs"]
  assert run["describe_images"] is True and run["lm"] == str(lm)
  for form in vlm_lm_skills.FORMS:
    scores = run["scores"][form]
    assert set(scores["kind"]) == {e.kind for e in examples}
    assert set(scores["digits"]) == {str(e.num_digits) for e in examples}
    weights = {k: sum(e.kind == k for e in examples) for k in scores["kind"]}
    overall = sum(scores["kind"][k] * n for k, n in weights.items()) / len(examples)
    assert scores["overall"] == pytest.approx(overall)
  assert "| described |" in (tmp_path / "vlm_lm_skills.md").read_text()
  assert record["eval_from"] == "latest" and "steps, checkpoint latest)" in (tmp_path / "vlm_lm_skills.md").read_text()
  for form in vlm_lm_skills.FORMS:  # each kind at each digit count: the examples, each counted once
    cells = run["scores"][form]["kind_digits"]
    assert sum(total for _, total in cells.values()) == len(examples)
    assert {cell: total for cell, (_, total) in cells.items()} == {
        f"{k}/{n}": sum(e.kind == k and e.num_digits == n for e in examples) for k, n in
        {(e.kind, e.num_digits) for e in examples}}
    assert sum(right for right, _ in cells.values()) == pytest.approx(run["scores"][form]["overall"] * len(examples))


def test_a_split_that_is_not_evaluated_on_is_refused(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    vlm_lm_skills.main(["--lm", str(tmp_path), "--split", "train", "--out", str(tmp_path)])
  assert exit_info.value.code == 2 and "--split: one of ('validation', 'test')" in capsys.readouterr().err
