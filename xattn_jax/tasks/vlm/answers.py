"""What a trained VLM answers: each target generated in turn from the prefix before it, in eval and in infer.

Eval generates every target in turn from the prefix before it (earlier targets given), cut at the token that
ends it (or EOS, or a marker), up to the task's `eval_new_tokens`: the longest eval target's tokens + 1, at least
task.decoding.max_new_tokens, so no reference is cut short by the limit (`eval_answers`, scored by
`answer_metrics`). Infer generates up to task.decoding.max_new_tokens, each target after the ones generated
before it (`generate_in_turn`). With task.describe_first (the bundled strips, whose LM learned their described
texts) eval and infer answer in two passes: the model describes each image alone (its caption), then the frozen
LM alone, no image and no connector, answers from the text with each image's description before its marker
(`described_answers`); a target right after an image is that image's description. It is an eval-time choice:
`--mode=eval` may set it on a finished run.

Each function takes the task (`task.VLMTask`) for its tokenizer, image marker, eval examples and `generate`.
"""
from __future__ import annotations

import numpy as np

from xattn_jax.data import tokenizers
from xattn_jax.models import vlm


def normalise(text: str) -> str:
  return " ".join(text.split())


def eval_answers(task, model) -> list[tuple[str, int, str, str]]:
  """(kind, digits in the largest image, reference, generated answer) of every eval target, in eval order:
  each generated from the prefix before it (earlier targets given), both sides whitespace-normalised
  (with task.describe_first: `described_answers`)."""
  if task.config.task.get("describe_first", False):
    return described_answers(task, model)
  requests, rows = [], []
  for example, layout in zip(task.eval_examples, task.eval_layouts):
    for prefix, stop, reference in layout.targets:
      requests.append((example.images, layout.ids[:prefix].tolist(), stop))
      rows.append((example.kind, example.num_digits, normalise(reference)))
  if not requests:
    return []
  return [row + (answer,) for row, answer in zip(rows, task.generate(model, requests, task.eval_new_tokens))]


def described_answers(task, model) -> list[tuple[str, int, str, str]]:
  """eval_answers in two passes (task.describe_first): the model describes each image alone (`describe`);
  then the frozen LM alone answers every other target from the example's text with each image replaced by
  its description and marker, as it read the described texts in pretraining ("seven two <image> what is
  their sum ?"; earlier targets given). A target right after an image is that image's description."""
  described = iter(task.describe(model, [image for example in task.eval_examples for image in example.images],
                                 task.eval_new_tokens))
  requests, rows = [], []
  for example, layout in zip(task.eval_examples, task.eval_layouts):
    words = [next(described) for _ in example.images]
    ids, previous, targets = [task.tokenizer.bos_id], ("text", None), iter(layout.targets)
    for role, value in example.segments:
      if role == "image":
        ids += task.tokenizer.encode(words[value]) + [task.marker]
      elif role == "text":
        ids += task.tokenizer.encode(str(value))
      else:
        _, stop, reference = next(targets)
        answer = words[previous[1]] if previous[0] == "image" else None
        if answer is None:
          requests.append(((), list(ids), stop))
        rows.append((example.kind, example.num_digits, normalise(reference), answer))
        ids += task.tokenizer.encode(str(value))
      previous = (role, value)
  answers = iter(task.generate(model, requests, task.eval_new_tokens, text_only=True))
  return [row[:3] + (next(answers) if row[3] is None else row[3],) for row in rows]


def answer_metrics(answers) -> dict[str, float]:
  """The eval metrics of `eval_answers`' rows (at least one): exact_match and chrf over them all, and
  exact_match per kind and per digit count of the largest image (none for 0: a user's pairs)."""
  kinds, digits, references, hypotheses = (list(column) for column in zip(*answers))
  correct = np.array([h == r for h, r in zip(hypotheses, references)], float)
  import sacrebleu  # imported here: only evaluation needs it
  metrics = {"exact_match": float(correct.mean()),
             "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score}
  kinds, digits = np.array(kinds), np.array(digits)
  for kind in sorted(set(kinds)):
    metrics[f"exact_match_{kind}"] = float(correct[kinds == kind].mean())
  for n in sorted(set(digits) - {0}):
    metrics[f"exact_match_{n}digits"] = float(correct[digits == n].mean())
  return metrics


def generate_in_turn(task, model, examples, names=None) -> list[list[str]]:
  """examples: (images, segments as VLMExample's, each target None) -> each example's targets, generated in
  turn from the prefix before it with the earlier ones in place (with task.describe_first: a target right after
  an image is that image's description, the others the frozen LM's from the described text). names: each
  example's sampling ids (its input line, its place there); a target samples by (*name, its index, 0), an
  image's description by (*name, the image, 1 << 16), whatever other examples are generated beside it."""
  tokenizer, marker = task.tokenizer, task.marker
  described = task.config.task.get("describe_first", False)
  if described:
    words = iter(task.describe(model, [image for images, _ in examples for image in images],
                               ids=None if names is None else [(*names[k], i, 1 << 16) for k, (images, _) in
                                                               enumerate(examples) for i in range(len(images))]))
    descriptions = [[next(words) for _ in images] for images, _ in examples]
  prefixes, done, answers = [[tokenizer.bos_id] for _ in examples], [0] * len(examples), [[] for _ in examples]
  while True:
    requests, asking = [], []
    for k, (images, segments) in enumerate(examples):
      while done[k] < len(segments):
        role, value = segments[done[k]]
        if role == "image":
          prefixes[k] += (tokenizer.encode(descriptions[k][value]) if described
                          else [vlm.SOFT_TOKEN] * task.slots(images[value])) + [marker]
        elif role == "text":
          prefixes[k] += tokenizer.encode(value)
        elif described and segments[done[k] - 1][0] == "image":  # a caption: the image's description
          answers[k].append(descriptions[k][segments[done[k] - 1][1]])
          prefixes[k] += tokenizer.encode(answers[k][-1])
        else:  # generated: cut where the training layout ends this target (Layout's end token)
          after = segments[done[k] + 1] if done[k] + 1 < len(segments) else ("end", None)
          if after[0] == "image":
            stop = marker
          elif after[0] == "text":
            stop = tokenizer.encode(after[1])[0]  # a question is never blank
          else:
            stop = tokenizers.EOS_ID
          requests.append(((() if described else images), list(prefixes[k]), stop))
          asking.append(k)
          break
        done[k] += 1
    if not requests:
      return answers
    ids = None if names is None else [(*names[k], len(answers[k]), 0) for k in asking]
    for k, answer in zip(asking, task.generate(model, requests, text_only=described, ids=ids)):
      answers[k].append(answer)
      prefixes[k] += tokenizer.encode(answer)
      done[k] += 1
