"""The one rule every name registry of the package keeps when code from outside adds an entry: position
encodings (layers.positions), attention implementations (ops.attention), decoding methods (decoding), VLM connectors
(models.connectors)."""
from __future__ import annotations


def check_new_name(function: str, registry, name, *, replace: bool) -> None:
  """ValueError (from `function`) unless name is a non-empty str not in registry yet (or replace is True)."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"{function}: name must be a non-empty str, got name={name!r}")
  if name in registry and not replace:
    raise ValueError(f"{function}: {name!r} is registered already (replace=True overrides it)")
