"""A bundled text corpus for language models, generated from Babel's CLDR data and a little code.

Nothing is downloaded: every document is made here, deterministically from a seed, one short line
each. The kinds (``DOCUMENT_KINDS``), with the default counts:

  number     12,000  "4,213 is four thousand two hundred thirteen." / "21st is the twenty-first."
                     (English number words from ``english_number``, up to the billions)
  date        8,000  "dimanche 29 novembre 2026": a day of 1900-2099, CLDR full / long / medium
  time        3,000  "14:05:09": CLDR short / medium times
  currency    3,000  "1.234,56 $ (US-Dollar)": an amount in a currency, with the currency's name
  unit        3,000  "12 kilomètres par heure": a measurement, long or short unit names
  territory   all    "Allemagne (DE)": every two-letter territory's name in each locale
  language    250    "allemand [de]": languages' names, per locale

Dates, times, currencies and units are written in the locales of ``DEFAULT_LOCALES``, chosen at
random per document. A text produced twice is kept once. The split into train and eval is by a
stable hash of the text (splits.py), so the two sides never share a document and a document's side
does not depend on the others.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import random

import babel
import babel.dates
import babel.numbers
import babel.units

from xattn_jax.data import splits

DEFAULT_LOCALES = ("en_US", "en_GB", "fr", "de", "es", "it", "pt_BR", "nl")

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ((10**9, "billion"), (10**6, "million"), (10**3, "thousand"))
_IRREGULAR_ORDINALS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                       "nine": "ninth", "twelve": "twelfth"}

_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "BRL", "MXN", "SEK", "NOK", "DKK",
               "PLN", "CZK", "HUF", "RUB", "TRY", "ZAR", "KRW", "SGD", "HKD", "NZD", "THB", "EGP", "NGN", "ARS")
_UNITS = ("length-kilometer", "length-meter", "length-centimeter", "length-mile", "length-foot", "mass-kilogram",
          "mass-gram", "mass-pound", "duration-hour", "duration-minute", "duration-second", "duration-day",
          "duration-week", "duration-month", "duration-year", "temperature-celsius", "volume-liter",
          "speed-kilometer-per-hour", "area-square-meter", "digital-megabyte", "energy-kilowatt-hour",
          "power-watt", "pressure-hectopascal")


def english_number(n: int) -> str:
  """The English words of an integer with |n| < 10**12, American style: 'one hundred one',
  'twenty-one', 'minus three', 'two million forty thousand'."""
  if isinstance(n, bool) or not isinstance(n, int) or abs(n) >= 10**12:
    raise ValueError(f"english_number: n must be an integer with |n| < 10**12, got {n!r}")
  if n < 0:
    return "minus " + english_number(-n)
  if n < 20:
    return _ONES[n]
  if n < 100:
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
  if n < 1000:
    hundreds, rest = divmod(n, 100)
    return f"{_ONES[hundreds]} hundred" + (f" {english_number(rest)}" if rest else "")
  scale, name = next((scale, name) for scale, name in _SCALES if n >= scale)
  high, rest = divmod(n, scale)
  return f"{english_number(high)} {name}" + (f" {english_number(rest)}" if rest else "")


def english_ordinal(n: int) -> str:
  """The English ordinal words of 0 <= n < 10**12: 'first', 'twelfth', 'twenty-first', 'one hundredth'."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"english_ordinal: n must be a non-negative integer, got {n!r}")
  words = english_number(n)
  cut = max(words.rfind(" "), words.rfind("-")) + 1
  head, last = words[:cut], words[cut:]
  if last in _IRREGULAR_ORDINALS:
    return head + _IRREGULAR_ORDINALS[last]
  return head + (last[:-1] + "ieth" if last.endswith("y") else last + "th")


def _ordinal_suffix(n: int) -> str:
  if n % 100 in (11, 12, 13):
    return "th"
  return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _numbers(rng: random.Random, count: int, locales) -> list[str]:
  del locales  # English only
  texts = []
  for _ in range(count):
    n = rng.randrange(1000) if rng.random() < 0.3 else int(10 ** rng.uniform(3, 9.5))
    if rng.random() < 0.7:
      texts.append(f"{n:,} is {english_number(n)}.")
    else:
      texts.append(f"{n:,}{_ordinal_suffix(n)} is the {english_ordinal(n)}.")
  return texts


def _dates(rng: random.Random, count: int, locales) -> list[str]:
  first, days = datetime.date(1900, 1, 1), (datetime.date(2099, 12, 31) - datetime.date(1900, 1, 1)).days + 1
  return [babel.dates.format_date(first + datetime.timedelta(days=rng.randrange(days)),
                                  format=rng.choice(("full", "long", "medium")), locale=rng.choice(locales))
          for _ in range(count)]


def _times(rng: random.Random, count: int, locales) -> list[str]:
  return [babel.dates.format_time(datetime.time(rng.randrange(24), rng.randrange(60), rng.randrange(60)),
                                  format=rng.choice(("short", "medium")), locale=rng.choice(locales))
          for _ in range(count)]


def _currencies(rng: random.Random, count: int, locales) -> list[str]:
  texts = []
  for _ in range(count):
    locale, code = babel.Locale.parse(rng.choice(locales)), rng.choice(_CURRENCIES)
    amount = round(10 ** rng.uniform(0, 6), 2)
    texts.append(f"{babel.numbers.format_currency(amount, code, locale=locale)} ({locale.currencies[code]})")
  return texts


def _units(rng: random.Random, count: int, locales) -> list[str]:
  texts = []
  for _ in range(count):
    value = rng.randrange(1, 1000) if rng.random() < 0.7 else round(rng.uniform(0, 100), 1)
    texts.append(babel.units.format_unit(value, rng.choice(_UNITS), length=rng.choice(("long", "short")),
                                         locale=rng.choice(locales)))
  return texts


def _territories(rng: random.Random, count: int | None, locales) -> list[str]:
  del rng, count  # every two-letter territory, in order
  return [f"{name} ({code})" for locale in locales
          for code, name in sorted(babel.Locale.parse(locale).territories.items()) if code.isalpha()]


def _languages(rng: random.Random, count: int, locales) -> list[str]:
  texts = []
  for locale in locales:
    names = sorted((code, name) for code, name in babel.Locale.parse(locale).languages.items()
                   if code.isalpha() and len(code) <= 3)
    texts += [f"{name} [{code}]" for code, name in rng.sample(names, min(count, len(names)))]
  return texts


# kind: (generator(rng, count, locales) -> texts, default count; None = every one there is)
_KINDS = {"number": (_numbers, 12_000), "date": (_dates, 8_000), "time": (_times, 3_000),
          "currency": (_currencies, 3_000), "unit": (_units, 3_000), "territory": (_territories, None),
          "language": (_languages, 250)}
DOCUMENT_KINDS = tuple(_KINDS)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Train and eval documents (one line of text each) and the kind of each, parallel to them."""
  train: tuple[str, ...]
  eval: tuple[str, ...]
  train_kinds: tuple[str, ...]
  eval_kinds: tuple[str, ...]


def documents(*, seed: int = 0, locales=DEFAULT_LOCALES) -> list[tuple[str, str]]:
  """(kind, text) for every generated document, kinds in DOCUMENT_KINDS order, each text once."""
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
  if isinstance(locales, str) or not locales:
    raise ValueError(f"locales must be a non-empty sequence of locale names, got {locales!r}")
  for locale in locales:
    try:
      babel.Locale.parse(locale)
    except (babel.UnknownLocaleError, ValueError, TypeError) as error:
      raise ValueError(f"locales: {locale!r} is not a locale Babel knows ({error})") from None
  seen, kept = set(), []
  for kind, (generate, count) in _KINDS.items():
    rng = random.Random(f"{seed}/{kind}")  # str seeds hash the same in every process and version
    for text in generate(rng, count, tuple(locales)):
      if text not in seen:
        seen.add(text)
        kept.append((kind, text))
  return kept


@functools.lru_cache(maxsize=4)
def default_corpus(*, seed: int = 0, eval_fraction: float = 0.05, locales=DEFAULT_LOCALES) -> Corpus:
  """The bundled documents split into train and eval by a stable hash of each text (about
  eval_fraction of them held out). About 33k documents; builds in about a second."""
  splits.check_eval_fraction(eval_fraction)
  train, evaluation = splits.split_by_key(documents(seed=seed, locales=tuple(locales)), lambda item: item[1],
                                          seed=seed, eval_fraction=eval_fraction)
  return Corpus(train=tuple(text for _, text in train), eval=tuple(text for _, text in evaluation),
                train_kinds=tuple(kind for kind, _ in train), eval_kinds=tuple(kind for kind, _ in evaluation))
