"""Shared pytest setup."""
import os

# Tests that spawn launch.py subprocesses must not inherit a device count set for this process.
os.environ.setdefault("PYTHONHASHSEED", "0")
