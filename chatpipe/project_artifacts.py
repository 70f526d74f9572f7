"""MLflow artifact locations relative to the project, so a moved or copied project keeps its artifacts.

MLflow stores a local artifact location as an absolute path (it resolves a relative one when the
experiment is created), so a project moved with ``mv`` or ``cp -r`` would still point at the old
``mlruns/``. chatpipe creates its experiment with the location ``project:mlruns/artifacts``
instead: MLflow keeps a URI of another scheme as it is, and derives the run and model locations
from it (``project:mlruns/artifacts/<run>/artifacts``). This module is that scheme's artifact
repository, registered through MLflow's public plugin entry point (``mlflow.artifact_repository``
in pyproject.toml): MLflow's local repository on the path resolved against the current directory,
the project root every stage, flow and ``mlflow ui`` runs from.
"""

from __future__ import annotations

from pathlib import Path

from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

SCHEME = "project"


def project_uri(relative: str) -> str:
    """``mlruns/artifacts`` -> ``project:mlruns/artifacts``."""
    return f"{SCHEME}:{relative}"


def project_path(uri: str) -> Path:
    """The local directory a ``project:`` URI names, seen from the current directory."""
    return Path(uri.removeprefix(f"{SCHEME}:")).resolve()


class ProjectArtifactRepository(LocalArtifactRepository):
    """MLflow's local artifact repository for ``project:<path relative to the project root>``."""

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None) -> None:
        if not artifact_uri.startswith(f"{SCHEME}:"):
            raise ValueError(f"{artifact_uri!r} is not a {SCHEME}: artifact URI")
        super().__init__(project_path(artifact_uri).as_uri(), tracking_uri, registry_uri)
