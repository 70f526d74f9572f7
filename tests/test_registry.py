"""The final model in the MLflow registry: a pyfunc model with a signature, one version per sha256,
``@latest`` / ``@champion`` aliases, loadable with ``mlflow.pyfunc.load_model`` and servable with
``mlflow models serve`` (real sqlite store, real server process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chatpipe import registry, tracking
from chatpipe.inference.engine import Engine
from chatpipe.model.loading import load_chat_model
from chatpipe.report import summary_values
from chatpipe.settings import TrackingSettings
from chatpipe.testing.chatmodel import make_artifacts

mlflow = pytest.importorskip("mlflow")


def results_for(sha: str, chatcore: float, bpb: float) -> dict:
    """An eval results document for an ``sft`` final model."""
    return {
        "stages": {
            "sft": {
                "bpb": bpb,
                "git_commit": "abc",
                "dvc_lock": "lock",
                "model_sha256": sha,
                "chatcore": {"chatcore": chatcore, "tasks": {}, "skipped": {}},
            }
        }
    }


@pytest.fixture()
def project(tmp_path, monkeypatch):
    """A directory laid out like the repo (artifacts/ with tokenizer + sft) with its own MLflow store."""
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith(("CHATPIPE_", "DVC_EXP_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    make_artifacts(tmp_path / "artifacts", seed=0)
    # an absolute URI: MLflow caches one store per URI string, so a relative one would reuse the
    # store (and directory) of the previous test
    settings = TrackingSettings.model_construct(
        uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db",
        artifact_root="mlruns/artifacts",
        experiment="chatpipe",
        enabled=True,
    )
    yield tmp_path, settings
    mlflow.set_tracking_uri(None)


def report_register(settings, chatcore: float, bpb: float) -> None:
    """What the report stage does at its end: open its run, register the final model."""
    from chatpipe.io import sha256_file
    from stages.report import register_final_model

    results = results_for(sha256_file(Path("artifacts/sft/model.pt")), chatcore, bpb)
    with tracking._stage_run("report", settings, {}, profile="tiny") as run:
        register_final_model(run, "chatpipe", results, summary_values(results))


def aliases(client) -> dict[str, str]:
    return {a: str(registry.alias_version(client, "chatpipe", a).version) for a in (registry.LATEST, registry.CHAMPION)}


@pytest.mark.slow
def test_latest_loads_as_pyfunc_and_answers_a_prompt(project):
    root, settings = project
    report_register(settings, chatcore=0.10, bpb=1.5)
    model = mlflow.pyfunc.load_model("models:/chatpipe@latest")
    assert [c.type.name for c in model.metadata.signature.inputs.inputs] == ["string"]
    assert {p.name for p in model.metadata.signature.params} == {"temperature", "top_k", "max_tokens", "seed"}
    replies = model.predict(["hello", "What is 12 + 7?"], params={"max_tokens": 8})
    loaded = load_chat_model("sft", artifacts=root / "artifacts", device="cpu")
    prompt = loaded.tokenizer.render_for_completion({"messages": [{"role": "user", "content": "hello"}]})
    expected = "".join(
        t for _, t in Engine(loaded.model, loaded.tokenizer).stream(prompt, max_tokens=8, temperature=0.0)
    )
    assert len(replies) == 2 and replies[0] == expected and replies[0].strip()
    # the chat CLI / web server resolve the same registered model
    assert load_chat_model("models:/chatpipe@latest", device="cpu", tracking_uri=settings.uri).stage == "sft"


@pytest.mark.slow
def test_same_sha256_is_registered_once_and_champion_moves_only_on_better_numbers(project):
    root, settings = project
    client = mlflow.MlflowClient(tracking_uri=settings.uri)
    report_register(settings, chatcore=0.10, bpb=1.5)
    report_register(settings, chatcore=0.10, bpb=1.5)  # the report re-run on the same weights
    assert [str(v.version) for v in client.search_model_versions("name = 'chatpipe'")] == ["1"]
    assert aliases(client) == {"latest": "1", "champion": "1"}

    make_artifacts(root / "artifacts", seed=1)  # new weights with worse numbers: latest, not champion
    report_register(settings, chatcore=0.05, bpb=1.6)
    assert aliases(client) == {"latest": "2", "champion": "1"}
    make_artifacts(root / "artifacts", seed=2)  # better numbers: both
    report_register(settings, chatcore=0.20, bpb=1.7)
    assert aliases(client) == {"latest": "3", "champion": "3"}
    v3 = client.get_model_version("chatpipe", "3")
    assert v3.tags["ChatCORE"] == "0.2000" and len(v3.tags[registry.SHA_TAG]) == 64
    assert len({client.get_model_version("chatpipe", v).tags[registry.SHA_TAG] for v in "123"}) == 3


def test_beats_compares_the_first_metric_both_have() -> None:
    assert registry.beats({"ChatCORE": "0.2", "bpb": "2"}, {"ChatCORE": "0.1", "bpb": "1"})[0]
    assert not registry.beats({"DCLM CORE": "0.1", "bpb": "0.9"}, {"DCLM CORE": "0.2", "bpb": "1.0"})[0]
    assert registry.beats({"ChatCORE": "0.3", "bpb": "0.9"}, {"DCLM CORE": "0.2", "bpb": "1.0"}) == (
        True,
        "bpb 0.9000 vs 1.0000",
    )
    assert not registry.beats({"bpb": "nan"}, {"bpb": "1.0"})[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_prompt(project):
    root, settings = project
    report_register(settings, chatcore=0.10, bpb=1.5)
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": settings.uri,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    cmd = [str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", "models:/chatpipe@latest"]
    cmd += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"]
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (
                f"mlflow models serve exited {proc.returncode}: {(root / 'serve.log').read_text()[-3000:]}"
            )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (root / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        r = httpx.post(
            f"http://127.0.0.1:{port}/invocations", json={"inputs": ["hello"], "params": {"max_tokens": 8}}, timeout=60
        )
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        expected = mlflow.pyfunc.load_model("models:/chatpipe@latest").predict(["hello"], params={"max_tokens": 8})
        assert predictions == expected and predictions[0].strip()
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (ours: started with a new session), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # already gone
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


# Register the final model in a project whose store and artifacts sit inside it (the default
# settings: relative paths), then, in a copy of the project with the original deleted, resolve the
# alias and answer a prompt. Each in its own process: MLflow caches one store per URI string.
REGISTER = """
import sys
from pathlib import Path
from chatpipe.settings import TrackingSettings
sys.path.insert(0, sys.argv[1])
from tests.test_registry import report_register
settings = TrackingSettings.model_construct(
    uri="sqlite:///mlruns/mlflow.db", artifact_root="mlruns/artifacts", experiment="chatpipe", enabled=True
)
report_register(settings, chatcore=0.10, bpb=1.5)
"""
LOAD = """
import json, mlflow
mlflow.set_tracking_uri("sqlite:///mlruns/mlflow.db")
client = mlflow.MlflowClient()
version = client.get_model_version_by_alias("chatpipe", "latest")
model = mlflow.pyfunc.load_model("models:/chatpipe@latest")
replies = model.predict(["hello"], params={"max_tokens": 4})
source = version.source
if source.startswith("models:/"):  # MLflow 3: a version points at a logged model, which holds the location
    source = client.get_logged_model(source.removeprefix("models:/")).artifact_location
print(json.dumps({"storage": source, "replies": list(replies)}))
"""


@pytest.mark.slow
def test_a_moved_projects_registered_model_resolves_and_loads(tmp_path):
    import json
    import shutil

    repo = Path(__file__).resolve().parents[1]
    original, moved = tmp_path / "original", tmp_path / "moved"
    make_artifacts(original / "artifacts", seed=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATPIPE_", "DVC_EXP_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(repo), CHATPIPE_PARAMS=str(repo / "params.yaml"))

    def run(code: str, cwd: Path) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code, str(repo)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    run(REGISTER, original)
    shutil.copytree(original, moved)
    shutil.rmtree(original)
    got = json.loads(run(LOAD, moved).strip().splitlines()[-1])
    assert got["storage"].startswith("store:artifacts/"), got  # nothing absolute to go stale
    assert len(got["replies"]) == 1 and got["replies"][0].strip(), got
