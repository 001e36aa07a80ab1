"""The engine's errors that end a run with a one-line message (launch.py prints them without a traceback).

A diverged run raises `guards.TrainingDiverged`; a bad config raises `validation.ConfigError`.
"""
from __future__ import annotations


class RunError(RuntimeError):
  """The run cannot proceed (e.g. nothing to evaluate); the message says why."""


class DataError(ValueError):
  """The task could not build its data or tokenizer from the configured files, or an inference input
  cannot be read; the message says which file (and line)."""
