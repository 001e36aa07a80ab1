"""The bundled language-model corpus: deterministic, split without overlap, several kinds of text."""
import collections

import pytest
from hypothesis import given, settings, strategies as st

from xattn_jax.data import corpus


@pytest.fixture(scope="module")
def default():
  return corpus.default_corpus()


def _words_to_number(words: str) -> int:
  """Reads english_number's words back (the inverse, written independently)."""
  units = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                      "thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split())}
  units.update({w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)})
  scales = {"thousand": 10**3, "million": 10**6, "billion": 10**9}
  sign, total, group = 1, 0, 0
  for word in words.replace("-", " ").split():
    if word == "minus":
      sign = -1
    elif word == "hundred":
      group *= 100
    elif word in scales:
      total, group = total + group * scales[word], 0
    else:
      group += units[word]
  return sign * (total + group)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12 + 1, 10**12 - 1))
def test_english_number_words_read_back_to_the_number(n):
  assert _words_to_number(corpus.english_number(n)) == n


def test_english_number_and_ordinal_spellings():
  assert [corpus.english_number(n) for n in (0, 15, 40, 101, 2_040_000)] == [
      "zero", "fifteen", "forty", "one hundred one", "two million forty thousand"]
  assert [corpus.english_ordinal(n) for n in (1, 2, 3, 12, 20, 21, 45, 100, 1000)] == [
      "first", "second", "third", "twelfth", "twentieth", "twenty-first", "forty-fifth", "one hundredth",
      "one thousandth"]


def test_documents_are_deterministic_given_the_seed():
  first = corpus.documents(seed=1, locales=("fr",))
  assert first == corpus.documents(seed=1, locales=("fr",))
  assert first != corpus.documents(seed=2, locales=("fr",))


def test_train_and_eval_share_no_document(default):
  assert not set(default.train) & set(default.eval)
  assert len(set(default.train)) == len(default.train) and len(set(default.eval)) == len(default.eval)
  assert 0.03 < len(default.eval) / (len(default.train) + len(default.eval)) < 0.07


def test_corpus_holds_tens_of_thousands_of_short_lines_of_every_kind(default):
  assert 20_000 < len(default.train) < 60_000
  assert all(text.strip() and "\n" not in text and len(text) < 200 for text in default.train + default.eval)
  train_kinds, eval_kinds = collections.Counter(default.train_kinds), collections.Counter(default.eval_kinds)
  assert set(train_kinds) == set(corpus.DOCUMENT_KINDS) and min(train_kinds.values()) > 500
  assert set(eval_kinds) == set(corpus.DOCUMENT_KINDS)
  text = "".join(default.train)
  assert all(word in text for word in ("novembre", "November", "noviembre", "thousand", "Allemagne", "Euro"))


@pytest.mark.parametrize("kwargs, message", [(dict(seed=-1), "seed"), (dict(locales=("xx_Nowhere",)), "locales"),
                                             (dict(locales="fr"), "locales")])
def test_bad_corpus_arguments_raise_naming_them(kwargs, message):
  with pytest.raises(ValueError, match=message):
    corpus.documents(**kwargs)


def test_numbers_beyond_the_supported_range_raise():
  with pytest.raises(ValueError, match=r"\|n\| < 10\*\*12"):
    corpus.english_number(10**12)
