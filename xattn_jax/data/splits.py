"""Deterministic train / eval membership from a stable hash of a key.

A key's side of the split depends only on (seed, key), not on which other keys exist, so
widening a date range or appending lines to a corpus never moves an old example across the
split, and identical keys (the same date in every format, a repeated source sentence) always
land on the same side.
"""
from __future__ import annotations

import hashlib

from absl import logging

# What a bundled task's run may evaluate on (its data.eval_split): validation while training (what a best
# checkpoint, early stopping and any choice of settings read), test once for the final score.
EVAL_SPLITS = ("validation", "test")


def stable_unit_interval(key: str, seed: int) -> float:
  """A number in [0, 1) fixed by (seed, key) across runs, processes and Python versions.

  Python's built-in ``hash`` is salted per process, so it cannot be used here.
  """
  digest = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") / 2.0**64


def check_eval_fraction(eval_fraction: float) -> None:
  """Raises ValueError unless 0 <= eval_fraction < 1."""
  if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be a number in [0, 1), got {eval_fraction!r}")


def far_below_fraction(eval_keys: int, keys: int, eval_fraction: float) -> bool:
  """Whether a hash split that holds out `eval_keys` of `keys` distinct keys is far below `eval_fraction`: under
  a quarter of the expected count where at least 20 are expected (by chance under 2e-5 for any such size). Keys
  drawn from one side of a split made with the same seed do that (none of a split's training keys hashes into
  its eval side again)."""
  expected = eval_fraction * keys
  return expected >= 20 and eval_keys < expected / 4


def is_eval_key(key: str, *, seed: int, eval_fraction: float) -> bool:
  """True if ``key`` belongs to the eval side of the split (about ``eval_fraction`` of all keys)."""
  return stable_unit_interval(key, seed) < eval_fraction


def split_by_key(items, key_fn, *, seed: int = 0, eval_fraction: float = 0.05, min_eval_keys: int = 0):
  """Splits ``items`` into (train, eval) lists, keeping the input order within each side.

  Every item with the same ``key_fn(item)`` goes to the same side, so an eval key is never seen
  in training. With ``min_eval_keys``, a split whose eval side holds fewer distinct keys (a small
  corpus, where about ``eval_fraction`` of the keys can round to none) takes the train keys of
  lowest hash until it holds that many, as long as a train key stays; those keys' sides then depend
  on the other keys too.
  """
  check_eval_fraction(eval_fraction)
  items = list(items)
  keys = [key_fn(item) for item in items]
  chosen = {key for key in keys if is_eval_key(key, seed=seed, eval_fraction=eval_fraction)}
  others = sorted(set(keys) - chosen, key=lambda key: stable_unit_interval(key, seed))
  chosen.update(others[:max(0, min(min_eval_keys - len(chosen), len(others) - 1))])
  train = [item for item, key in zip(items, keys) if key not in chosen]
  evaluation = [item for item, key in zip(items, keys) if key in chosen]
  return train, evaluation


def warn_shared(evaluation, train, eval_file: str, train_file: str, what: str) -> None:
  """Logs how many of the eval items (keys: a pair's source, a document) are training items too: allowed (a check
  of memorisation), but the eval's scores are then not held-out scores."""
  seen = set(train)
  shared = sum(item in seen for item in evaluation)
  if shared:
    logging.warning("%d of the %d eval %s in %s are also training %s in %s: eval metrics are not held-out scores",
                    shared, len(evaluation), what, eval_file, what, train_file)
