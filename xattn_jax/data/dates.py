"""English -> target-locale date translation pairs from the CLDR data that Babel ships.

Each calendar day in a year range gives one pair per CLDR date format, the source written in the
source locale (``en_US``) and the target in the target locale, both in the same format:

  full     Sunday, November 29, 2026  ->  dimanche 29 novembre 2026
  long     November 29, 2026          ->  29 novembre 2026
  medium   Nov 29, 2026               ->  29 nov. 2026
  short    11/29/26                   ->  29/11/2026    (not a default: the two-digit year is
                                                          ambiguous across centuries)

The split into train, eval (validation) and an optional test side is by DATE (a stable hash of the ISO
date and the seed), so an eval or test date is never seen in training in any format.

Every English source string is kept once: pairs are generated in date order, then in the order of
``formats``, and a later pair whose source was already produced is dropped (and counted). This keeps
source -> target a function. It matters because some sources coincide across formats, e.g. ``May 29,
2026`` is both the en_US ``long`` and ``medium`` form while German writes ``29. Mai 2026`` (long) and
``29.05.2026`` (medium); and with ``short``, ``11/29/26`` stands for both 1926 and 2026.

Babel formats about 100k dates a second and the default job needs ~440k strings, so each field's
text is looked up in a table per weekday / day / month / year and put into Babel's own parsed
pattern: the same output several times faster (tests compare it with ``babel.dates.format_date``).
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import re

import babel
import babel.dates
import babel.localedata

from xattn_jax.data import splits

DATE_FORMATS = ("full", "long", "medium", "short")
DEFAULT_FORMATS = ("full", "long", "medium")

_FIELD_NAME = re.compile(r"%\((\w+)\)s")


@dataclasses.dataclass(frozen=True)
class DatePairs:
  """Train, eval and test (source, target) string pairs, split by date.

  Attributes:
    train: training pairs, in date order then format order.
    eval: held-out pairs (a translator evaluates on them while it trains); none of their dates is in ``train``.
    test: held-out pairs for a final score (empty unless test_fraction > 0); none of their dates is on
      another side.
    train_dates / eval_dates / test_dates: the date of each pair, parallel to ``train`` / ``eval`` / ``test``.
    source_locale / target_locale / formats: what generated them.
    num_train_dates / num_eval_dates / num_test_dates: calendar days on each side of the split.
    num_dropped_duplicates: pairs dropped because their source string had already been produced
      by an earlier date or format (see the module docstring).
  """
  train: list[tuple[str, str]]
  eval: list[tuple[str, str]]
  train_dates: list[datetime.date]
  eval_dates: list[datetime.date]
  source_locale: str
  target_locale: str
  formats: tuple[str, ...]
  num_train_dates: int
  num_eval_dates: int
  num_dropped_duplicates: int
  test: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  test_dates: list[datetime.date] = dataclasses.field(default_factory=list)
  num_test_dates: int = 0


def parse_locale(name, argument: str = "target_locale") -> babel.Locale:
  """The Babel locale for ``name`` (``fr``, ``de_CH``, ``pt-BR``, ...), or ValueError naming a few valid ones."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"{argument} must be a non-empty locale name such as 'fr', got {name!r}")
  try:
    return babel.Locale.parse(name.replace("-", "_"))
  except (babel.UnknownLocaleError, ValueError, TypeError) as error:
    known = babel.localedata.locale_identifiers()
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"close matches: {', '.join(close)}; " if close else ""
    raise ValueError(
        f"{argument}={name!r} is not a locale Babel knows ({error}); {hint}valid ones include fr, de, es, it, "
        f"ja, zh_Hant, pt_BR (babel.localedata.locale_identifiers() lists all {len(known)})") from None


class _CachedDateFormatter:
  """Formats dates in one CLDR format and locale from per-field lookup tables.

  Babel's parsed pattern is a %-template such as ``'%(EEEE)s %(d)s %(MMMM)s %(y)s'``. The text of a
  weekday, day or month field depends on nothing else, so it is formatted once per value; year
  fields are cached per year; any other field (week of year, day of year, ...) is formatted by
  Babel on every call.
  """

  def __init__(self, format_name: str, locale: babel.Locale):
    self._locale = locale
    template = babel.dates.get_date_format(format_name, locale=locale).format
    self._template = _FIELD_NAME.sub("%s", template)  # '%%' (a literal percent) is left as it is
    self._getters = tuple(self._getter(field) for field in _FIELD_NAME.findall(template))

  def _babel_field(self, field: str, date: datetime.date) -> str:
    return babel.dates.DateTimeFormat(date, self._locale)[field]

  def _getter(self, field: str):
    """A function date -> the text of ``field``."""
    kind = field[0]
    if kind in "Eec":  # 2024-01-01 is a Monday, weekday() == 0
      weekdays = [self._babel_field(field, datetime.date(2024, 1, 1 + i)) for i in range(7)]
      return lambda date: weekdays[date.weekday()]
    if kind == "d":
      days = [None] + [self._babel_field(field, datetime.date(2024, 1, day)) for day in range(1, 32)]
      return lambda date: days[date.day]
    if kind in "ML":
      months = [None] + [self._babel_field(field, datetime.date(2024, month, 1)) for month in range(1, 13)]
      return lambda date: months[date.month]
    if kind in "yG":
      years: dict[int, str] = {}
      def year_text(date):
        text = years.get(date.year)
        if text is None:
          text = years[date.year] = self._babel_field(field, date)
        return text
      return year_text
    return functools.partial(self._babel_field, field)

  def __call__(self, date: datetime.date) -> str:
    return self._template % tuple([getter(date) for getter in self._getters])


def date_pairs(target_locale: str = "fr", *, formats=DEFAULT_FORMATS, first_year: int = 1900,
               last_year: int = 2099, eval_fraction: float = 0.01, seed: int = 0,
               source_locale: str = "en_US", test_fraction: float = 0.0) -> DatePairs:
  """Generates (English date, target-locale date) pairs for every day of ``first_year..last_year``.

  Args:
    target_locale: any locale Babel knows (``fr``, ``de``, ``ja``, ``pt_BR``, ...).
    formats: CLDR format names from ``DATE_FORMATS``; source and target use the same one.
    first_year, last_year: inclusive year range (1..9999).
    eval_fraction: about this fraction of the DATES goes to eval, chosen by a stable hash of
      (seed, ISO date), so widening the range keeps every old date on its side.
    seed: selects the split.
    source_locale: the locale of the source side.
    test_fraction: about this fraction of the dates goes to test: those whose hash lies in
      [eval_fraction, eval_fraction + test_fraction), so the eval side does not move with it.

  Returns:
    DatePairs. The default (fr, 1900-2099, 3 formats, 1% eval) has ~72.3k training dates and
    ~0.7k eval dates: ~217k training and ~2.2k eval pairs. Builds in about a second.
  """
  target = parse_locale(target_locale, "target_locale")
  source = parse_locale(source_locale, "source_locale")
  if isinstance(formats, str) or not formats:
    raise ValueError(f"formats must be a non-empty sequence of names from {DATE_FORMATS}, got {formats!r}")
  formats = tuple(formats)
  unknown = [f for f in formats if f not in DATE_FORMATS]
  if unknown or len(set(formats)) != len(formats):
    raise ValueError(f"formats must be distinct names from {DATE_FORMATS}, got {formats!r}")
  for name, year in (("first_year", first_year), ("last_year", last_year)):
    if isinstance(year, bool) or not isinstance(year, int) or not 1 <= year <= 9999:
      raise ValueError(f"{name} must be an integer year in 1..9999, got {year!r}")
  if first_year > last_year:
    raise ValueError(f"first_year must be <= last_year, got first_year={first_year}, last_year={last_year}")
  splits.check_eval_fraction(eval_fraction)
  splits.check_eval_fraction(test_fraction)
  if eval_fraction + test_fraction >= 1.0:
    raise ValueError(f"eval_fraction + test_fraction must be < 1 (some dates train), got {eval_fraction} + "
                     f"{test_fraction}")

  formatters = [(_CachedDateFormatter(f, source), _CachedDateFormatter(f, target)) for f in formats]
  sides = {name: ([], []) for name in ("train", "eval", "test")}  # name: (pairs, their dates)
  counts = dict.fromkeys(sides, 0)
  num_dropped = 0
  seen_sources: set[str] = set()
  date, last = datetime.date(first_year, 1, 1), datetime.date(last_year, 12, 31)
  one_day = datetime.timedelta(days=1)
  while True:
    hashed = splits.stable_unit_interval(date.isoformat(), seed)  # splits.is_eval_key's test, widened to test
    name = "eval" if hashed < eval_fraction else "test" if hashed < eval_fraction + test_fraction else "train"
    counts[name] += 1
    side, side_dates = sides[name]
    for format_source, format_target in formatters:
      source_text = format_source(date)
      if source_text in seen_sources:
        num_dropped += 1
        continue
      seen_sources.add(source_text)
      side.append((source_text, format_target(date)))
      side_dates.append(date)
    if date == last:
      break
    date += one_day
  (train, train_dates), (evaluation, eval_dates), (test, test_dates) = sides.values()
  return DatePairs(train=train, eval=evaluation, train_dates=train_dates, eval_dates=eval_dates,
                   source_locale=str(source), target_locale=str(target), formats=formats,
                   num_train_dates=counts["train"], num_eval_dates=counts["eval"], num_dropped_duplicates=num_dropped,
                   test=test, test_dates=test_dates, num_test_dates=counts["test"])
