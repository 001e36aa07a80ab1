"""Date translation pairs: they are Babel's CLDR output, split by date, deterministic."""
import datetime

import babel.dates
import pytest
from hypothesis import given, settings, strategies as st

from xattn_jax.data import dates


@pytest.fixture(scope="module")
def french():
  return dates.date_pairs("fr", first_year=2020, last_year=2029, eval_fraction=0.1)


def test_no_eval_date_or_source_appears_in_training(french):
  assert french.eval, "the split must hold some eval dates"
  assert not set(french.train_dates) & set(french.eval_dates)
  assert not {s for s, _ in french.train} & {s for s, _ in french.eval}


def test_dates_are_parallel_to_pairs_and_cover_the_range(french):
  assert len(french.train_dates) == len(french.train) and len(french.eval_dates) == len(french.eval)
  days = set(french.train_dates) | set(french.eval_dates)
  assert len(days) == french.num_train_dates + french.num_eval_dates == (datetime.date(2030, 1, 1) - datetime.date(2020, 1, 1)).days
  assert min(days) == datetime.date(2020, 1, 1) and max(days) == datetime.date(2029, 12, 31)


def test_split_is_deterministic_and_changes_with_seed(french):
  again = dates.date_pairs("fr", first_year=2020, last_year=2029, eval_fraction=0.1)
  other_seed = dates.date_pairs("fr", first_year=2020, last_year=2029, eval_fraction=0.1, seed=1)
  assert again == french
  assert set(other_seed.eval_dates) != set(french.eval_dates)


def test_a_dates_side_does_not_depend_on_the_year_range(french):
  wider = dates.date_pairs("fr", first_year=2015, last_year=2029, eval_fraction=0.1)
  assert set(french.eval_dates) <= set(wider.eval_dates)
  assert set(french.train_dates) <= set(wider.train_dates)


def test_eval_fraction_of_dates_is_close_to_the_request(french):
  fraction = french.num_eval_dates / (french.num_train_dates + french.num_eval_dates)
  assert abs(fraction - 0.1) < 0.02


def test_french_examples_from_the_brief():
  pairs = dates.date_pairs("fr", first_year=2026, last_year=2026, eval_fraction=0.0)
  assert ("Sunday, November 29, 2026", "dimanche 29 novembre 2026") in pairs.train
  assert ("Nov 29, 2026", "29 nov. 2026") in pairs.train


@pytest.mark.parametrize("locale", ["de", "ja"])
def test_pairs_are_babels_formatting_of_their_date(locale):
  pairs = dates.date_pairs(locale, first_year=1999, last_year=2000, eval_fraction=0.3)
  for (source, target), date in list(zip(pairs.train + pairs.eval, pairs.train_dates + pairs.eval_dates))[::97]:
    matching = [f for f in pairs.formats if babel.dates.format_date(date, format=f, locale="en_US") == source]
    assert matching, (source, date)
    assert target == babel.dates.format_date(date, format=matching[0], locale=locale)


@settings(max_examples=40, deadline=None)
@given(day=st.dates(datetime.date(1, 1, 1), datetime.date(9999, 12, 31)),
       locale=st.sampled_from(["fr", "de", "ja", "ru", "ar", "pl", "zh_Hant", "en_US"]),
       format_name=st.sampled_from(dates.DATE_FORMATS))
def test_cached_formatter_equals_babel(day, locale, format_name):
  formatter = dates._CachedDateFormatter(format_name, dates.parse_locale(locale))
  formatter(day + datetime.timedelta(days=1) if day.year < 9999 else day)  # fill the cache with a neighbour first
  assert formatter(day) == babel.dates.format_date(day, format=format_name, locale=locale)


def test_every_requested_format_appears(french):
  for format_name in dates.DEFAULT_FORMATS:
    assert any(source == babel.dates.format_date(date, format=format_name, locale="en_US")
               for (source, _), date in zip(french.train[:30], french.train_dates[:30])), format_name


def test_each_source_has_a_single_target_when_formats_collide():
  pairs = dates.date_pairs("de", first_year=2026, last_year=2026, eval_fraction=0.0)
  sources = [s for s, _ in pairs.train]
  assert len(sources) == len(set(sources))
  # en_US writes "May 29, 2026" in both long and medium; German does not: one pair survives.
  assert [t for s, t in pairs.train if s == "May 29, 2026"] == ["29. Mai 2026"]
  assert pairs.num_dropped_duplicates == 31


def test_short_format_keeps_the_first_century_for_two_digit_years():
  pairs = dates.date_pairs("fr", formats=("short",), first_year=1926, last_year=2026, eval_fraction=0.0)
  by_source = dict(pairs.train)
  assert by_source["11/29/26"] == "29/11/1926"
  assert len(by_source) == len(pairs.train)


def test_unknown_locale_raises_naming_valid_ones():
  with pytest.raises(ValueError, match=r"target_locale='klingon' is not a locale.*valid ones include fr, de"):
    dates.date_pairs("klingon")


@pytest.mark.parametrize("kwargs, message", [
    ({"formats": ("full", "tiny")}, "formats"),
    ({"formats": "full"}, "formats"),
    ({"first_year": 2000, "last_year": 1999}, "first_year must be <= last_year"),
    ({"first_year": 0}, "first_year"),
    ({"eval_fraction": 1.0}, "eval_fraction"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
  with pytest.raises(ValueError, match=message):
    dates.date_pairs("fr", **kwargs)


def test_every_french_eval_word_occurs_in_training(french):
  """Eval dates are new combinations of known parts: no word of an eval pair is unseen in training."""
  train_words = {word for pair in french.train for text in pair for word in text.split()}
  assert {word for pair in french.eval for text in pair for word in text.split()} <= train_words


def test_a_test_side_takes_dates_from_training_only(french):
  with_test = dates.date_pairs("fr", first_year=2020, last_year=2029, eval_fraction=0.1, test_fraction=0.1)
  assert with_test.eval == french.eval and not french.test  # the eval side does not move; no test by default
  sides = (with_test.train_dates, with_test.eval_dates, with_test.test_dates)
  assert all(not set(a) & set(b) for i, a in enumerate(sides) for b in sides[i + 1:])
  assert not {s for s, _ in with_test.test} & {s for s, _ in with_test.train}
  assert set(with_test.train_dates) | set(with_test.test_dates) == set(french.train_dates)
  assert len(with_test.test_dates) == len(with_test.test)
  total = with_test.num_train_dates + with_test.num_eval_dates + with_test.num_test_dates
  assert total == french.num_train_dates + french.num_eval_dates
  assert abs(with_test.num_test_dates / total - 0.1) < 0.02


@pytest.mark.parametrize("eval_fraction, test_fraction", [(0.5, 0.5), (0.0, 1.0), (0.1, -0.1)])
def test_the_held_out_sides_must_leave_some_training_dates(eval_fraction, test_fraction):
  with pytest.raises(ValueError, match="fraction"):
    dates.date_pairs("fr", first_year=2020, last_year=2020, eval_fraction=eval_fraction, test_fraction=test_fraction)
