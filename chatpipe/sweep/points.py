"""One content-addressed work directory per sweep point, and the stages run inside it.

A point's directory is ``<runs>/<name>-<hash>``; the hash covers the point's resolved settings
(every section but where it runs and logs), the code (``chatpipe/`` and ``stages/``) and the
input data. So the same point in two sweeps, or in a sweep run twice, is the same directory, and:

- ``done.json`` (written atomically after the last stage) makes a finished point never train again;
- ``.sweep/<stage>.done`` lets a killed point skip the stages it finished;
- ``checkpoints/`` in the directory lets the stage that was killed resume where it stopped.

The data and tokenizer stages of points that share their settings run once, in a ``prep-<hash>``
directory the points link to (a 12-point isoFLOP grid trains one tokenizer, not twelve).
Each directory is a copy of the code and a fully resolved ``params.yaml``, and each stage runs there
through the torchx launcher (``python -m chatpipe.launch <stage>``), so the ``slurm`` profile makes it
Slurm jobs. Points never share a file they write.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from chatpipe.io import atomic_dir, fingerprint, sha256_file, write_json_atomic
from chatpipe.sweep.spec import PLACEMENT_SECTIONS, point_stages

CODE_DIRS = ("chatpipe", "stages")
CODE_FILES = ("dvc.yaml",)  # the list of stages the copied code reads (chatpipe.settings.pipeline)
PREP_STAGES = ("data", "tokenizer")  # shared by every point with the same data and tokenizer settings
DONE = "done.json"
# the stage-owned sections a point's identity covers (the sections of the stages it runs and their inputs)
_ENV_DROP = ("CHATPIPE_PARAMS", "CHATPIPE_PROFILE", "CHATPIPE_PROFILES")


def code_fingerprint(repo: Path, stages: list[str]) -> str:
    """Hash of the source files the stages import (their import closure, as ``chatpipe.lineage`` finds it).

    Only those: editing the sweep's own modules, a test or the README leaves every finished point valid.
    """
    from chatpipe.lineage import import_closure, stage_code_deps

    launcher = [p.relative_to(repo).as_posix() for p in import_closure(repo, repo / "chatpipe" / "launch.py")]
    deps = sorted({dep for stage in stages for dep in stage_code_deps(repo, stage)} | set(launcher))
    return fingerprint({dep: sha256_file(repo / dep) for dep in deps})


def snapshot_code(repo: Path, runs: Path, code: str) -> Path:
    """Copy the code once per sweep run into ``<runs>/code-<hash>``: points copy from there, so editing the
    repo while a sweep runs cannot give later points other code than their hash says."""
    dest = runs / f"code-{code}"
    if not dest.exists():
        with atomic_dir(dest) as tmp:
            for top in CODE_DIRS:
                shutil.copytree(repo / top, tmp / top, ignore=shutil.ignore_patterns("__pycache__"))
            for name in CODE_FILES:
                shutil.copy2(repo / name, tmp / name)
    return dest


def data_fingerprint(data: dict[str, Any]) -> str:
    """The input data's identity: its settings, plus the files' hashes for a local source (they can change)."""
    files = {}
    if data.get("source") == "local" and data.get("local_dir"):
        root = Path(data["local_dir"])
        files = {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
    return fingerprint({"settings": data, "files": files})


def identity(params: dict[str, Any], stages: list[str], code: str) -> dict[str, Any]:
    """What a directory's content depends on: the sections up to its last stage (not launch/tracking)."""
    order = point_stages()
    upto = order[: order.index(stages[-1]) + 1]
    sections = {s: params.get(s) for s in upto if s not in PLACEMENT_SECTIONS}
    return {
        "settings": sections,
        "stages": list(stages),
        "code": code,
        "data": data_fingerprint(params.get("data", {})),
    }


class WorkDir:
    """A directory that runs some stages of one resolved params set (a point, or the shared prep)."""

    def __init__(self, root: Path, name: str, params: dict[str, Any], stages: list[str], code: str) -> None:
        self.params, self.stages = params, list(stages)
        self.key = fingerprint(identity(params, self.stages, code))
        # the hash is the identity, the name only a reading aid: another sweep's point with the same
        # content (named after another grid) is this point
        same = sorted(root.glob(f"*-{self.key}")) if root.is_dir() else []
        self.path = same[0] if same else root / f"{name}-{self.key}"

    @property
    def done(self) -> dict[str, Any] | None:
        """The completion record, or None while unfinished."""
        import json

        marker = self.path / DONE
        return json.loads(marker.read_text()) if marker.exists() else None

    def prepare(self, repo: Path, links: dict[str, Path] | None = None) -> None:
        """Copy the code and write params.yaml (idempotent; a resumed point keeps its checkpoints)."""
        for top in CODE_DIRS:
            shutil.copytree(
                repo / top, self.path / top, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        for name in CODE_FILES:
            shutil.copy2(repo / name, self.path / name)
        text = yaml.safe_dump({**self.params, "profile": "tiny"}, sort_keys=False)
        # every value is resolved here already: `tiny` (no overlay) keeps the stages from re-applying a profile
        (self.path / "params.yaml").write_text(text)
        for rel, target in (links or {}).items():  # the shared prep's outputs, read-only for the point
            link = self.path / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(target.resolve(), target_is_directory=True)

    def stage_done(self, stage: str) -> bool:
        return (self.path / ".sweep" / f"{stage}.done").exists()

    def run_stages(self, env: dict[str, str], on_start=None) -> list[str]:
        """Run each unfinished stage through the launcher; returns the stages that ran.

        ``on_start(proc)`` gets each launcher process (a session of its own) so a caller can stop it.
        Raises RuntimeError with the log's tail when a stage fails.
        """
        ran = []
        for stage in self.stages:
            if self.stage_done(stage):
                continue
            log_path = self.path / "logs" / f"sweep-{stage}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "chatpipe.launch", stage],
                    cwd=self.path,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: a stop reaches the launcher's workers too
                )
                if on_start:
                    on_start(proc)
                rc = proc.wait()
            if rc != 0:
                tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"{self.path.name}: stage {stage} failed (exit {rc}); {log_path}:\n{tail}")
            marker = self.path / ".sweep" / f"{stage}.done"
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            ran.append(stage)
        return ran

    def finish(self, record: dict[str, Any]) -> None:
        """Write the completion record last and atomically: a point is finished exactly when it exists."""
        write_json_atomic(self.path / DONE, {**record, "key": self.key, "stages": self.stages})


def point_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment minus the settings that would point a point at the main project's params."""
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def collect_metrics(path: Path, names: list[str]) -> dict[str, float]:
    """``stage.key`` values from the directory's ``metrics/<stage>.json`` (missing ones are left out)."""
    import json

    out = {}
    for name in names:
        stage, key = name.split(".", 1)
        file = path / "metrics" / f"{stage}.json"
        if file.exists():
            data = json.loads(file.read_text())
            value = data.get(stage, data).get(key)  # metrics/<stage>.json nests its values under the stage
            if isinstance(value, (int, float)):
                out[name] = float(value)
    return out


def now() -> float:
    return time.time()
