"""MLflow artifact locations stored relative to the tracking store, so a moved or copied project
(store and artifacts together) keeps its artifacts.

MLflow stores a local artifact location as an absolute path (it resolves a relative one when the
experiment is created), so a project moved with ``mv`` or ``cp -r`` would still point at the old
``mlruns/``. chatpipe creates its experiment with the location ``store:artifacts`` instead (the
artifact root relative to the sqlite file's directory): MLflow keeps a URI of another scheme as it
is and derives the run and model locations from it (``store:artifacts/<run>/artifacts``). This
module is that scheme's artifact repository, registered through MLflow's public plugin entry point
(``mlflow.artifact_repository`` in pyproject.toml): MLflow's local repository on the path resolved
against the directory of the sqlite store being read, so any process that opens the store, by
whatever path and from whatever directory, finds the artifacts beside it.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

SCHEME = "store"
SQLITE = "sqlite:///"
# Where ``mlflow server``/``mlflow ui`` keeps its --backend-store-uri (mlflow.server.BACKEND_STORE_URI_ENV_VAR;
# tests/test_tracking.py checks the name against the pinned MLflow). Not imported: mlflow.server loads Flask.
SERVER_STORE_ENV = "_MLFLOW_SERVER_FILE_STORE"


def store_dir(tracking_uri: str) -> Path:
    """The directory of a ``sqlite:///`` store (relative paths against the current directory)."""
    if not tracking_uri.startswith(SQLITE):
        raise ValueError(f"{SCHEME}: artifact locations need a sqlite:/// tracking store, not {tracking_uri!r}")
    return Path(tracking_uri.removeprefix(SQLITE)).resolve().parent


def store_uri(artifact_root: Path, tracking_uri: str) -> str:
    """``mlruns/artifacts`` with the store ``sqlite:///mlruns/mlflow.db`` -> ``store:artifacts``."""
    return f"{SCHEME}:{Path(os.path.relpath(artifact_root.resolve(), store_dir(tracking_uri))).as_posix()}"


class ProjectArtifactRepository(LocalArtifactRepository):
    """MLflow's local artifact repository for ``store:<path relative to the sqlite store's directory>``.

    The store is the client's (``tracking_uri``), else, inside ``mlflow server``/``mlflow ui``, the
    server's backend store, else MLflow's current tracking URI.
    """

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None) -> None:
        if not artifact_uri.startswith(f"{SCHEME}:"):
            raise ValueError(f"{artifact_uri!r} is not a {SCHEME}: artifact URI")
        import mlflow  # here: MLflow loads this module while it loads its plugins

        store = tracking_uri or os.environ.get(SERVER_STORE_ENV) or mlflow.get_tracking_uri()
        path = (store_dir(store) / artifact_uri.removeprefix(f"{SCHEME}:")).resolve()
        super().__init__(path.as_uri(), tracking_uri, registry_uri)
