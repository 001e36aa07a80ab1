"""Corpus BLEU as the translate task reports it (eval/bleu): the sacrebleu tokenizer that suits a set of
references and whether BLEU is defined for them (`bleu_choice`), and the score itself (`corpus_bleu`).
"""
from __future__ import annotations

from typing import NamedTuple

import sacrebleu

BLEU_TOKENIZERS = ("auto", "13a", "intl", "char", "zh", "none")  # sacrebleu's, with no extra installs


def _written_without_spaces(char: str) -> bool:
  """Han, kana, Thai, Lao, Tibetan, Myanmar, Khmer: scripts that do not separate words by spaces."""
  code = ord(char)
  return (0x3040 <= code <= 0x30FF or 0x3400 <= code <= 0x4DBF or 0x4E00 <= code <= 0x9FFF
          or 0xF900 <= code <= 0xFAFF or 0x20000 <= code <= 0x3134F or 0x0E00 <= code <= 0x0EFF
          or 0x0F00 <= code <= 0x0FFF or 0x1000 <= code <= 0x109F or 0x1780 <= code <= 0x17FF)


# Corpus BLEU multiplies the 1- to BLEU_MAX_ORDER-gram precisions: a corpus whose references mostly have
# fewer tokens than that has (almost) no 4-grams, and its BLEU is 0 or rests on the few that do.
BLEU_MAX_ORDER = 4


class BleuChoice(NamedTuple):
  """How eval/bleu scores a corpus: sacrebleu's `tokenize`, whether BLEU is `defined` there, and why."""
  tokenize: str
  defined: bool
  reason: str


def _short_references(references, tokenize: str) -> int:
  """How many references have fewer than BLEU_MAX_ORDER tokens under sacrebleu's `tokenize`."""
  tokenizer = sacrebleu.BLEU(tokenize=tokenize).tokenizer
  return sum(len(tokenizer(text).split()) < BLEU_MAX_ORDER for text in references)


def corpus_bleu(hypotheses: list[str], references: list[str], tokenize: str) -> float:
  """sacrebleu's corpus BLEU, at most 100: its geometric mean reads 100.00000000000004 for a perfect corpus."""
  return min(100.0, sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize).score)


def bleu_choice(references, setting: str = "auto") -> BleuChoice:
  """The sacrebleu tokenizer for these reference texts, and whether corpus BLEU is defined for them.

  `setting` is task.bleu_tokenize. "auto" picks "char" when most of the references' letters are in
  scripts written without spaces; else "13a" when at least half the references have 4 or more "13a"
  tokens (words and punctuation); else "char" (single words, compound words, short answers: "13a"
  would give them no word 4-grams). With the tokenizer chosen, BLEU is defined when at least half
  the references have 4 or more tokens; otherwise its 4-gram precision would rest on the few that do
  (and be 0 when none does, even for exact translations), so it is reported as undefined.
  """
  references = list(references)
  count = len(references)
  if not count:
    return BleuChoice("13a" if setting == "auto" else setting, False, "there are no references")
  if setting != "auto":
    tokenize, why = setting, f"task.bleu_tokenize={setting!r}"
  else:
    letters = [c for text in references for c in text if c.isalpha()]
    if letters and sum(map(_written_without_spaces, letters)) > len(letters) / 2:
      tokenize, why = "char", ("most of the references' letters are in scripts written without spaces, which "
                               "'13a' splits only at spaces")
    else:
      short = _short_references(references, "13a")
      if 2 * short <= count:
        return BleuChoice("13a", True, f"{count - short} of the {count} references have {BLEU_MAX_ORDER} or more "
                          "'13a' tokens (words and punctuation)")
      tokenize, why = "char", (f"{short} of the {count} references have fewer than {BLEU_MAX_ORDER} '13a' tokens "
                               "(words and punctuation), so word 4-grams mostly do not exist; characters are scored")
  short = _short_references(references, tokenize)
  if 2 * short > count:
    return BleuChoice(tokenize, False, f"{why}, and {short} of the {count} references have fewer than "
                      f"{BLEU_MAX_ORDER} {tokenize!r} tokens: most have no {BLEU_MAX_ORDER}-grams for BLEU to count, "
                      "and with none at all BLEU is 0 even for exact translations")
  if setting != "auto":
    why = f"{count - short} of the {count} references have {BLEU_MAX_ORDER} or more {tokenize!r} tokens"
  return BleuChoice(tokenize, True, why)


def bleu_tokenizer(references, setting: str = "auto") -> str:
  """The sacrebleu tokenizer bleu_choice picks for these reference texts."""
  return bleu_choice(references, setting).tokenize
