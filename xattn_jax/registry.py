"""The rules every name registry of the package keeps when code from outside adds an entry: position encodings
(layers.positions), attention implementations (ops.attention), decoding methods (decoding), VLM connectors
(models.connectors), optimizers and schedules (training.optim).

Each register_* function checks the name (`check_new_name`) and adds the entry through `add`, which remembers the
module whose import ran the registration. A run's recorded config.py lists the entries its config names that
code outside xattn_jax added (`named_by`) and imports their modules again when it is loaded (`restore`), so the
record reproduces the run in a fresh process: resume, eval, infer, `loop.load_model`.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys

PACKAGE = __name__.partition(".")[0]


def check_new_name(function: str, registry, name, *, replace: bool) -> None:
  """ValueError (from `function`) unless name is a non-empty str not in registry yet (or replace is True)."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"{function}: name must be a non-empty str, got name={name!r}")
  if name in registry and not replace:
    raise ValueError(f"{function}: {name!r} is registered already (replace=True overrides it)")


@dataclasses.dataclass(frozen=True)
class _Added:
  """An entry code outside the package added: the registry and the entry (live while registry[name] is entry), the
  module whose import registered it, and the folder on sys.path it imports from (None: no import by name runs it)."""
  registry: dict
  entry: object
  module: str
  folder: str | None


# {register function: {name: _Added}}, for the entries code outside the package added in this process.
_ADDED: dict[str, dict[str, _Added]] = {}


def _registering_module() -> tuple[str, str | None]:
  """(name, import folder or None) of the module whose import runs the register call that called `add`: the
  innermost module-level frame above it, so that a helper of the fork's registering on its behalf counts as the
  fork's module. A frame of __main__ (a script, a notebook, a call after the imports) or of a file loaded by path
  under another name (a config file: its path is named beside) has no folder: importing it by name would not
  register the entry."""
  frame = sys._getframe(1)
  while frame is not None and frame.f_code.co_name != "<module>":
    frame = frame.f_back
  if frame is None:
    return "?", None
  module, path = frame.f_globals.get("__name__", "?"), frame.f_globals.get("__file__")
  if not isinstance(path, str):
    return module, None
  path = os.path.abspath(path)
  for tail in (os.path.join(*module.split(".")) + ".py", os.path.join(*module.split("."), "__init__.py")):
    if module != "__main__" and path.endswith(os.sep + tail):
      return module, path[:-len(tail) - 1]
  return f"{module} ({path})", None


def add(function: str, registry: dict, name: str, entry) -> None:
  """registry[name] = entry, for `function` (a register_* function that checked name and entry), remembering the
  module that registered it unless that is the package's own."""
  registry[name] = entry
  module, folder = _registering_module()
  if module == PACKAGE or module.startswith(PACKAGE + "."):
    _ADDED.get(function, {}).pop(name, None)
  else:
    _ADDED.setdefault(function, {})[name] = _Added(registry, entry, module, folder)


def _live(function: str, name: str) -> _Added | None:
  added = _ADDED.get(function, {}).get(name)
  return added if added is not None and added.registry.get(name) is added.entry else None


def named_by(fields: dict) -> list[tuple[str, str, str, str, str | None]]:
  """(field, register function, name, module, folder) for each entry added from outside the package (and still
  registered) whose name is the value of one of `fields` ({dotted field: value}; a list's items count), in field
  order: what a config naming them needs imported before it is validated."""
  if not isinstance(fields, dict):
    raise ValueError(f"named_by: fields must be a dict {{dotted field: value}}, got {type(fields).__name__}")
  found = []
  for field, value in fields.items():
    for item in (value if isinstance(value, (list, tuple)) else (value,)):
      if not isinstance(item, str):
        continue
      for function in _ADDED:
        added = _live(function, item)
        if added is not None:
          found.append((field, function, item, added.module, added.folder))
  return found


def restore(entries) -> None:
  """Makes each entry `named_by` listed registered in this process: one registered already stays; else its module
  is imported (from its folder, appended to sys.path, where the name alone does not find it). ValueError naming
  the field, the entry, the module and what to do where that does not register it."""
  if not isinstance(entries, (list, tuple)) or not all(
      isinstance(e, (list, tuple)) and len(e) == 5 and all(isinstance(part, str) for part in e[:4])
      and isinstance(e[4], (str, type(None))) for e in entries):
    raise ValueError("restore: entries must be a list of (field, register function, name, module, folder or None) "
                     f"as named_by returns, got {entries!r}")
  for field, function, name, module, folder in entries:
    if _live(function, name) is not None:
      continue
    where = f"{field}={name!r} names an entry that {function} added in {module}"
    if folder is None:
      raise ValueError(f"{where}, where no import by name runs it (a script, a notebook, a config file, a call after "
                       "the imports), so loading this config cannot add it again: register it at the top level of a "
                       "module the config file imports, or before loading the config")
    try:
      try:
        importlib.import_module(module)
      except ModuleNotFoundError as error:
        if error.name is None or not (module == error.name or module.startswith(error.name + ".")):
          raise
        if folder in sys.path or not os.path.isdir(folder):
          raise
        sys.path.append(folder)
        importlib.import_module(module)
    except Exception as error:
      missing = isinstance(error, ModuleNotFoundError) and error.name and (
          module == error.name or module.startswith(error.name + "."))
      advice = (f"restore the module in {folder}, or put the folder that holds it now on PYTHONPATH" if missing
                else f"fix the module (imported from {folder})")
      raise ValueError(f"{where}; importing it failed ({type(error).__name__}: {' '.join(str(error).split())}): "
                       f"{advice}") from error
    if _live(function, name) is None:
      raise ValueError(f"{where}, and importing that module registers no {name!r} now: register it at the "
                       "module's top level again, or name another entry")
