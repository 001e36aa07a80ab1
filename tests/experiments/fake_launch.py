"""A stand-in for the sweep runners' launch.py subprocesses (experiments/sweep.py), so a runner's own work (cells
skipped or run, result.json, tables, plots, provenance) is tested without training: each cell's launch writes what
a finished run leaves behind and exits at once. Training those configs is tested with launch.py itself."""
import json
import pathlib
import subprocess

from experiments import sweep


class FakeLaunch:
  """Patched in as `sweep.subprocess`: Popen(command) writes the workdir's config.json (the config the command
  resolves to, as launch.py records it) and a metrics.jsonl whose last eval holds every key of `keys` (accuracies
  0.5, losses 1.5), then ends with status 0. `commands` lists the commands launched."""

  def __init__(self, keys):
    self.keys, self.commands = tuple(keys), []
    self.STDOUT = subprocess.STDOUT

  def Popen(self, command, **kwargs):  # noqa: N802 - subprocess's name
    del kwargs
    self.commands.append(command)
    workdir = pathlib.Path(next(a for a in command if a.startswith("--workdir=")).split("=", 1)[1])
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(sweep.resolved_config(command).to_json_best_effort(indent=2))
    row = {"step": 6, **{key: 1.5 if key.endswith("loss") else 0.5 for key in self.keys}}
    (workdir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    return _Ended()


class _Ended:
  """A process that already ended with status 0."""

  def wait(self):
    return 0

  def send_signal(self, signum):
    del signum
