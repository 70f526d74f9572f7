"""Every hf path against a real hub-compatible server: olah serving repos built from ../shared/data.

A fault-injecting proxy (tests/faultproxy.py) sits between the clients and olah; its log is the
access log the byte counts come from. Clients run in subprocesses with only ``HF_ENDPOINT``
pointing at the proxy, so huggingface_hub is used exactly as in a real run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from chatpipe.testing.hub_mirror import BUNDLE_URL, PRETRAIN_REPO, Mirror, build_repos, free_port
from chatpipe.testing.project import BIN, make_project, project_env, run
from tests.conftest import REPO, require_shared_data
from tests.faultproxy import FAULTS, FaultProxy

# What the speedrun's hf paths fetch, in one process: the data stage's shards, every task split
# the mixtures/RL/ChatCORE read, and the CORE bundle. Artifacts land in argv[1].
FETCH_ALL = """
import hashlib, json, os, sys
from pathlib import Path
from chatpipe.data.fetch import fetch_zip
from chatpipe.data.sources import prepare_text
from chatpipe.data.tasks import build_task
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
prepare_text(out / "data", source="hf", hf_num_shards=4, cache_dir=Path("cache"))
tasks = [("smoltalk", "train"), ("smoltalk", "val"), ("mmlu", "train"), ("mmlu", "test"), ("arc_easy", "test"),
         ("arc_challenge", "test"), ("gsm8k", "train"), ("gsm8k", "test")]
convs = {f"{n}/{s}": list(build_task(n, s, source="hf")) for n, s in tasks}
tmp = out / ".tasks.json.tmp"
tmp.write_text(json.dumps(convs, sort_keys=True)); os.replace(tmp, out / "tasks.json")
fetch_zip(sys.argv[2], out / "eval_bundle")
print("fetched all")
"""


@dataclass
class Hub:
    root: Path
    commits: dict[str, str]
    proxy: FaultProxy
    mirror: Mirror

    @property
    def url(self) -> str:
        return self.proxy.url


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Hub:
    """olah on a free port serving freshly built repos, behind the fault proxy; both stopped at the end."""
    data = require_shared_data()
    root = tmp_path_factory.mktemp("hub")
    commits = build_repos(data, root)
    olah_port = free_port()
    proxy = FaultProxy(f"http://127.0.0.1:{olah_port}").start()
    mirror = Mirror(root, olah_port, public_netloc=proxy.netloc)  # absolute URLs olah writes point at the proxy
    try:
        mirror.start()
        yield Hub(root, commits, proxy, mirror)
    finally:
        mirror.stop()
        proxy.stop()


def client_env(hub: Hub, workdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATPIPE_", "HF_"))}
    env.update(
        {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(workdir / "hf_home"),  # nothing read from or written to the user's hub cache
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "CHATPIPE_HUB_CACHE": "cache",
            "CHATPIPE_HUB_RETRIES": "3",
            "CHATPIPE_HUB_BACKOFF_S": "0.05",
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        }
    )
    env.update(extra)
    return env


def fetch_all(hub: Hub, workdir: Path, **env: str) -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", FETCH_ALL, "out", BUNDLE_URL],
        cwd=workdir,
        env=client_env(hub, workdir, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file below ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def cache_dir_of(workdir: Path, repo: str) -> Path:
    """huggingface_hub's folder of a dataset repo in the workdir's hub cache."""
    return workdir / "cache" / f"datasets--{repo.replace('/', '--')}"


def assert_no_partial_files(workdir: Path) -> None:
    """Nothing half-downloaded anywhere; every file in the hub cache's snapshots is a blob whose content
    has the hash the blob is named by (the hub's git blob sha1 or LFS sha256): nothing corrupt stayed."""
    from huggingface_hub.utils.sha import git_hash

    leftovers = [p for p in workdir.rglob("*") if p.is_file() and (".incomplete" in p.name or ".tmp" in p.name)]
    assert not leftovers, leftovers
    cache = workdir / "cache"
    for p in cache.glob("datasets--*/snapshots/**/*"):
        if p.is_dir():
            continue
        assert p.exists(), f"{p.relative_to(cache)} points at no blob"
        blob = p.resolve()
        data = blob.read_bytes()
        actual = hashlib.sha256(data).hexdigest() if len(blob.name) == 64 else git_hash(data)
        assert actual == blob.name, f"{p.relative_to(cache)}: content does not match the hub's hash {blob.name}"
    out = workdir / "out"
    if out.exists():  # only complete artifacts: each written atomically
        assert not [p for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())


@pytest.fixture(scope="module")
def clean_run(hub, tmp_path_factory) -> dict[str, str]:
    """Artifacts of a fault-free fetch of everything; also checks the manifest and a no-request second run."""
    workdir = tmp_path_factory.mktemp("clean")
    hub.proxy.clear()
    proc = fetch_all(hub, workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = hub.proxy.body_bytes()
    assert first > 0
    hub.proxy.clear()
    proc = fetch_all(hub, workdir)  # same cache, artifacts already there: rewritten from the cache
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert hub.proxy.log == [], f"second run made requests: {hub.proxy.log[:5]}"
    assert_no_partial_files(workdir)
    return digests(workdir / "out")


def test_data_manifest_records_what_was_fetched(hub, clean_run, tmp_path):
    proc = fetch_all(hub, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads((tmp_path / "out" / "data" / "manifest.json").read_text())["hub_files"]
    assert [r["file"] for r in records] == [f"shard_{i:05d}.parquet" for i in range(4)]
    for r in records:
        assert set(r) == {"repo", "revision", "file", "size", "sha256"}
        assert r["revision"] == hub.commits[r["repo"]]  # the branch resolved to its commit
        origin = hub.root / "datasets" / r["repo"] / r["file"]
        assert origin.stat().st_size == r["size"]
        assert hashlib.sha256(origin.read_bytes()).hexdigest() == r["sha256"]  # the very bytes the mirror holds
        cached = cache_dir_of(tmp_path, r["repo"]) / "snapshots" / r["revision"] / r["file"]
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == r["sha256"]
    assert (cache_dir_of(tmp_path, PRETRAIN_REPO) / "refs" / "main").read_text() == hub.commits[PRETRAIN_REPO]
    assert digests(tmp_path / "out") == clean_run


def test_offline_reads_the_cache_and_an_empty_cache_names_the_file(hub, clean_run, tmp_path):
    """``HF_HUB_OFFLINE=1`` with no hub to reach: every hf path is served from a filled cache; with an
    empty one the run stops at once, naming repo, file and revision (offline is not retried)."""
    proc = fetch_all(hub, tmp_path / "filled")
    assert proc.returncode == 0, proc.stderr[-4000:]
    shutil.rmtree(tmp_path / "filled" / "out")
    hub.proxy.clear()
    offline = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    proc = fetch_all(hub, tmp_path / "filled", **offline)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert hub.proxy.log == [] and digests(tmp_path / "filled" / "out") == clean_run
    t0 = time.monotonic()
    proc = fetch_all(hub, tmp_path / "empty", **offline)
    assert proc.returncode != 0
    assert f"HubError: hub dataset '{PRETRAIN_REPO}', file 'shard_00000.parquet" in proc.stderr, proc.stderr[-3000:]
    assert "revision 'main': OfflineModeIsEnabled" in proc.stderr and "gave up" not in proc.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "empty" / "out" / "data").exists()


def test_missing_file_fails_at_once_naming_repo_file_revision(hub, tmp_path):
    code = (
        "from pathlib import Path\nfrom chatpipe.data.sources import prepare_text\n"
        "prepare_text(Path('out/data'), source='hf', hf_num_shards=9, cache_dir=Path('cache'))\n"
    )
    hub.proxy.clear()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=client_env(hub, tmp_path), capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert f"hub dataset '{PRETRAIN_REPO}', file 'shard_00004.parquet', revision 'main'" in proc.stderr
    assert "no such file" in proc.stderr and time.monotonic() - t0 < 60
    assert not (tmp_path / "out" / "data").exists()
    assert_no_partial_files(tmp_path)


def _inject(proxy: FaultProxy, kind: str, times: int) -> None:
    proxy.inject(kind, times, match="/resolve/", method="GET")
    if kind in ("500", "429"):  # bursts also hit the metadata requests
        proxy.inject(kind, times, match="/resolve/", method="HEAD")
        proxy.inject(kind, times, match="/api/", method="GET")


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAULTS)
def test_fault_burst_is_retried_and_artifacts_match(hub, clean_run, tmp_path, kind):
    hub.proxy.clear()
    _inject(hub.proxy, kind, times=2)
    proc = fetch_all(hub, tmp_path)
    log = hub.proxy.log
    hub.proxy.clear()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sum(e.fault == kind for e in log) >= 2, "the fault was never injected"
    assert digests(tmp_path / "out") == clean_run
    assert_no_partial_files(tmp_path)
    # No Range resume is asserted for "drop": huggingface_hub writes the body in 10 MB chunks, so a drop
    # inside a smaller file leaves nothing to resume from, and olah ignores Range anyway (answers 200).


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAULTS)
def test_persistent_fault_fails_naming_file_and_leaves_nothing_partial(hub, tmp_path, kind):
    hub.proxy.clear()
    _inject(hub.proxy, kind, times=10_000)
    proc = fetch_all(hub, tmp_path, CHATPIPE_HUB_RETRIES="1")
    hub.proxy.clear()
    assert proc.returncode != 0
    want = re.escape(f"HubError: hub dataset '{PRETRAIN_REPO}', file '") + r"[^']+" + re.escape("', revision 'main'")
    assert re.search(want, proc.stderr), proc.stderr[-3000:]
    assert "gave up after 2 attempts" in proc.stderr, proc.stderr[-3000:]  # retried, not failed at once
    assert not (tmp_path / "out" / "data").exists()
    assert_no_partial_files(tmp_path)


def test_hf_and_local_sources_give_identical_tokenized_data(hub, clean_run, tmp_path):
    """The data stage's shards via hf vs. the same parquet files via data.source: local."""
    code = """
import hashlib, sys
from pathlib import Path
from chatpipe.data.sources import iter_documents, prepare_text
from chatpipe.tokenizer import Tokenizer
prepare_text(Path("hf"), source="hf", hf_num_shards=4, cache_dir=Path("cache"))
prepare_text(Path("local"), source="local", local_dir=Path(sys.argv[1]), docs_per_shard=100)
tok = Tokenizer.train(iter_documents(Path("hf"), "train"), vocab_size=400)
for name in ("hf", "local"):
    h = hashlib.sha256()
    for split in ("train", "val"):
        for doc in iter_documents(Path(name), split):
            h.update(split.encode()); h.update(repr(tok.encode(doc)).encode())
    print(name, h.hexdigest())
print("tok_local", hashlib.sha256(repr(sorted(Tokenizer.train(iter_documents(Path("local"), "train"), vocab_size=400).enc._mergeable_ranks.items())).encode()).hexdigest())
print("tok_hf", hashlib.sha256(repr(sorted(tok.enc._mergeable_ranks.items())).encode()).hexdigest())
"""
    local_dir = hub.root / "datasets" / PRETRAIN_REPO  # the repo's files, as an air-gapped copy would hold them
    proc = subprocess.run(
        [sys.executable, "-c", code, str(local_dir)],
        cwd=tmp_path,
        env=client_env(hub, tmp_path),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = dict(line.split() for line in proc.stdout.splitlines() if line.startswith(("hf ", "local ", "tok_")))
    assert got["hf"] == got["local"], got
    assert got["tok_hf"] == got["tok_local"], got
    local_manifest = json.loads((tmp_path / "local" / "manifest.json").read_text())
    hf_manifest = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    assert (
        local_manifest["num_docs"] == hf_manifest["num_docs"]
        and local_manifest["num_chars"] == hf_manifest["num_chars"]
    )


# ---------------------------------------------------------------------- the rehearsal profile, end to end

_LAUNCH = re.compile(r"\[launch\] (\w+): (?:(SUCCEEDED|FAILED|CANCELLED|UNKNOWN) \(([\d.]+) s\)|\S)")


def run_flow(project: Path, hub: Hub, prefect_url: str, *args: str) -> tuple[int, str, dict[str, dict]]:
    """Run the Prefect flow, reporting to ``prefect_url``; per stage: wall seconds (launcher) and body
    bytes the proxy sent meanwhile."""
    hf = {"HF_ENDPOINT": hub.url, "HF_HOME": str(project / ".hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env = project_env(project, **hf, PREFECT_API_URL=prefect_url)
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the stages' output, with the launcher's "[launch] <stage>" lines
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.pipeline", *args],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stages: dict[str, dict] = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = _LAUNCH.search(line)
        if not m:
            continue
        now = time.monotonic()
        stage = m.group(1)
        if m.group(2) is None and stage not in stages:
            stages[stage] = {"start": now}
        elif m.group(2) is not None and stage in stages:
            stages[stage].update(end=now, state=m.group(2), seconds=float(m.group(3)))
    rc = proc.wait()
    log = hub.proxy.log
    for info in stages.values():
        window = [e for e in log if info["start"] <= e.t <= info.get("end", float("inf"))]
        info["bytes"] = sum(e.body_bytes for e in window)
        info["requests"] = len(window)
    return rc, "".join(lines), stages


@pytest.mark.slow
def test_rehearsal_pipeline_against_the_mirror(hub, prefect_server, tmp_path):
    # the mirror is the subject; MLflow (tests/test_pipeline.py) stays off: ~5 s of CPU a stage process
    project = make_project(tmp_path / "project", {"profile": "rehearsal", "tracking": {"enabled": False}}, small=False)
    hub.proxy.clear()
    t0 = time.monotonic()
    rc, out, stages = run_flow(project, hub, prefect_server, "--profile", "rehearsal")
    wall = time.monotonic() - t0
    total_bytes = hub.proxy.body_bytes()
    summary = {
        "wall_s": round(wall, 1),
        "bytes": total_bytes,
        "requests": len(hub.proxy.log),
        "stages": {
            s: {k: v for k, v in i.items() if k in ("seconds", "bytes", "requests", "state")} for s, i in stages.items()
        },
    }
    print("rehearsal:", json.dumps(summary, indent=1))
    (tmp_path / "rehearsal_summary.json").write_text(json.dumps(summary, indent=1))
    assert rc == 0, out[-6000:]
    expected = ["data", "tokenizer", "pretrain", "midtrain", "sft", "rl", "eval", "report"]
    assert [s for s in expected if stages.get(s, {}).get("state") == "SUCCEEDED"] == expected, out[-4000:]
    assert wall < 600, f"rehearsal took {wall:.0f}s (> 10 min)"
    assert stages["data"]["bytes"] > 0 and total_bytes > 0
    results = json.loads((project / "artifacts" / "eval" / "results.json").read_text())
    text = json.dumps(results)
    for task in ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K"):
        assert task in text, f"{task} missing from eval results"
    assert (project / "data" / "eval_bundle" / "eval_data").is_dir()  # the bundle came from the mirror

    # A second run: every stage up to date, nothing transferred.
    hub.proxy.clear()
    rc, out, _ = run_flow(project, hub, prefect_server, "--profile", "rehearsal")
    assert rc == 0, out[-4000:]
    assert hub.proxy.log == [], f"second run made requests: {hub.proxy.log[:5]}"

    # Even stages forced to re-run fetch nothing: the data stage and every hf task/bundle path read the cache.
    run(project, str(BIN / "dvc"), "repro", "--force", "--single-item", "data", HF_ENDPOINT=hub.url)
    reload = (
        "from chatpipe.data.tasks import build_task\nfrom chatpipe.data.fetch import fetch_zip\nfrom pathlib import Path\n"
        "for n, s in [('smoltalk','train'),('smoltalk','val'),('mmlu','train'),('mmlu','val'),('mmlu','test'),"
        "('gsm8k','train'),('gsm8k','val'),('gsm8k','test'),('arc_easy','test'),('arc_challenge','test')]:\n"
        "    build_task(n, s, source='hf')\n"
        f"fetch_zip('{BUNDLE_URL}', Path('data/eval_bundle_again'))\n"
    )
    run(project, sys.executable, "-c", reload, HF_ENDPOINT=hub.url)
    assert hub.proxy.log == [], f"forced re-run made requests: {hub.proxy.log[:5]}"


# ---------------------------------------------------------------------- unit logic (no server)


def _http_error(status: int, **headers: str):
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    response = httpx.Response(status, headers=headers, request=httpx.Request("GET", "http://hub.invalid/x"))
    return HfHubHTTPError(f"{status}", response=response)


def test_transient_errors_are_told_from_permanent_ones():
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    from chatpipe.data import hub

    for status in (408, 429, 500, 502, 503, 504):
        assert hub.is_transient(_http_error(status))
    for status in (400, 401, 403, 404):
        assert not hub.is_transient(_http_error(status))
    import httpx2  # what huggingface_hub 2.4 raises with (not httpx)

    assert hub.is_transient(httpx2.RemoteProtocolError("peer closed connection"))
    assert hub.is_transient(httpx2.ReadError("connection reset"))
    assert hub.is_transient(hub.ChecksumMismatch("sha256 differs"))
    assert hub.is_transient(OSError("Consistency check failed: file should be of size 10 but has size 5"))
    assert not hub.is_transient(ValueError("bad"))
    wrapped = LocalEntryNotFoundError("cannot find the requested files")  # how the client reports a failed HEAD
    wrapped.__cause__ = _http_error(503)
    assert hub.is_transient(wrapped)
    offline = LocalEntryNotFoundError("outgoing traffic has been disabled")
    offline.__cause__ = OfflineModeIsEnabled("HF_HUB_OFFLINE=1")  # a ConnectionError, yet permanent
    assert not hub.is_transient(offline) and not hub.is_transient(OfflineModeIsEnabled("off"))


def test_a_blob_that_fails_its_hash_is_removed_and_a_good_one_recorded(tmp_path):
    """What a download is checked against: the hash its blob is named by (git blob sha1, or LFS sha256)."""
    from huggingface_hub.utils.sha import git_hash

    from chatpipe.data import hub

    good, bad = b"the hub's bytes\n", b"the hub's bytez\n"
    for name in (git_hash(good), hashlib.sha256(good).hexdigest()):
        blobs, snapshot = tmp_path / name / "blobs", tmp_path / name / "snapshots" / ("c" * 40) / "data"
        blobs.mkdir(parents=True)
        snapshot.mkdir(parents=True)
        (blobs / name).write_bytes(bad)
        (snapshot / "a.txt").symlink_to(blobs / name)
        with pytest.raises(hub.ChecksumMismatch, match=f"!= {name}"):
            hub._hub_file("org/x", "data/a.txt", str(snapshot / "a.txt"), check=True)
        assert not (blobs / name).exists() and not (snapshot / "a.txt").is_symlink()  # the retry downloads again
        (blobs / name).write_bytes(good)
        (snapshot / "a.txt").symlink_to(blobs / name)
        got = hub._hub_file("org/x", "data/a.txt", str(snapshot / "a.txt"), check=True)
        assert (got.revision, got.size, got.sha256) == ("c" * 40, len(good), hashlib.sha256(good).hexdigest())


def test_retries_then_names_repo_file_revision(monkeypatch):
    from chatpipe.data import hub

    monkeypatch.setenv("CHATPIPE_HUB_RETRIES", "2")
    monkeypatch.setenv("CHATPIPE_HUB_BACKOFF_S", "0")
    calls = []

    def flaky():
        calls.append(1)
        raise _http_error(503)

    with pytest.raises(hub.HubError, match=r"hub dataset 'org/x', file 'a.parquet', revision 'main': gave up after 3"):
        hub.with_retries(flaky, repo="org/x", file="a.parquet", revision="main")
    assert len(calls) == 3
    calls.clear()

    def missing():
        calls.append(1)
        raise _http_error(404)

    with pytest.raises(hub.HubError, match="404"):
        hub.with_retries(missing, repo="org/x", file="a.parquet", revision="main")
    assert len(calls) == 1  # permanent: no retry


def test_dataset_card_configs_pick_split_files():
    from chatpipe.data.hub import _config_patterns

    card = (
        "---\nconfigs:\n- config_name: all\n  data_files:\n  - split: test\n    path: all/test-*\n"
        "  - split: auxiliary_train\n    path: [all/auxiliary_train-*]\n- config_name: plain\n  data_files: d/*.parquet\n"
        "---\n# MMLU\n"
    )
    assert _config_patterns(card, "all", "test") == ["all/test-*"]
    assert _config_patterns(card, "all", "auxiliary_train") == ["all/auxiliary_train-*"]
    assert _config_patterns(card, "all", "validation") == []
    assert _config_patterns(card, "plain", "train") == ["d/*.parquet"]
    assert _config_patterns(card, "other", "train") is None
    assert _config_patterns("# no header\n", "all", "test") is None


@pytest.mark.slow
def test_datasets_load_dataset_reads_the_mirror_like_load_hf(hub, tmp_path):
    """Unmodified ``datasets.load_dataset`` accepts the mirror's repos and picks the same rows as load_hf."""
    code = """
import json
from datasets import load_dataset
from chatpipe.data.tasks.base import load_hf
for repo, config, split in [("cais/mmlu", "auxiliary_train", "train"), ("cais/mmlu", "all", "test"),
                            ("allenai/ai2_arc", "ARC-Challenge", "validation"), ("openai/gsm8k", "main", "test"),
                            ("HuggingFaceTB/smoltalk", "all", "test")]:
    ours = load_hf(repo, config, split)
    theirs = [dict(r) for r in load_dataset(repo, config, split=split, cache_dir="ds_cache")]
    print(repo, config, split, len(ours), ours == theirs)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=client_env(hub, tmp_path), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 5 and all(line.endswith(" True") for line in lines), proc.stdout


@pytest.mark.slow
def test_dropped_download_resumes_with_range_where_the_server_allows(hub, tmp_path):
    """Against a Range-capable server (the proxy slicing olah's answers, as the hub's file servers do),
    a body dropped midway is resumed from the bytes already on disk, and the file still verifies."""
    import random

    from chatpipe.testing.hub_mirror import _git

    size = 24 << 20  # past huggingface_hub's 10 MB write chunk, so the drop leaves bytes to resume from
    content = random.Random(0).randbytes(size)
    repo = hub.root / "datasets" / "chatpipe" / "resume_probe"
    if not repo.exists():
        repo.mkdir(parents=True)
        (repo / "big.bin").write_bytes(content)
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "resume probe")
    code = (
        "from pathlib import Path\nfrom chatpipe.data import hub\n"
        "(f,) = hub.fetch_files('chatpipe/resume_probe', ['big.bin'], cache_dir=Path('cache'))\nprint(f.sha256)\n"
    )
    with FaultProxy(hub.mirror.url, ranges=True) as proxy:
        proxy.inject("drop", times=1, match="big.bin")
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=client_env(hub, tmp_path, HF_ENDPOINT=proxy.url),
            capture_output=True,
            text=True,
        )
        gets = [e for e in proxy.log if e.method == "GET" and "big.bin" in e.path]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == hashlib.sha256(content).hexdigest()
    assert gets[0].fault == "drop" and gets[0].range is None
    resumed = gets[1]
    assert resumed.status == 206 and resumed.range and resumed.range.startswith("bytes=")
    start = int(resumed.range[len("bytes=") :].split("-")[0])
    assert 0 < start <= size // 2 and resumed.body_bytes == size - start  # only the missing tail came again
    assert_no_partial_files(tmp_path)


@pytest.mark.slow
def test_bundle_over_plain_https_style_url_is_retried_and_checked(hub, tmp_path):
    """The speedrun's bundle path (an http(s) URL read by fsspec): a corrupt burst is retried, a
    persistent one fails naming the URL and leaves no bundle dir."""
    url = f"{hub.url}/datasets/chatpipe/eval_bundle/resolve/main/eval_bundle.zip"
    code = "import sys\nfrom pathlib import Path\nfrom chatpipe.data.fetch import fetch_zip\nfetch_zip(sys.argv[1], Path(sys.argv[2]))\n"

    def fetch(dest: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, url, dest],
            cwd=tmp_path,
            env=client_env(hub, tmp_path, **env),
            capture_output=True,
            text=True,
        )

    hub.proxy.clear()
    assert fetch("clean").returncode == 0
    hub.proxy.inject("corrupt", 2, match="eval_bundle.zip")
    proc = fetch("after_faults")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(e.fault == "corrupt" for e in hub.proxy.log) == 2, "the faults were never served"
    assert digests(tmp_path / "after_faults") == digests(tmp_path / "clean")
    hub.proxy.inject("truncate", 10_000, match="eval_bundle.zip")
    proc = fetch("never", CHATPIPE_HUB_RETRIES="1")
    hub.proxy.clear()
    assert proc.returncode != 0 and f"{url}: gave up after 2 attempts" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_download_progress_goes_through_chatpipe_progress(hub, tmp_path):
    """Off a terminal (CI, torchx, Prefect) the client's byte counts reach chatpipe.progress's log line."""
    code = (
        "import logging\nfrom pathlib import Path\nfrom chatpipe.data import hub\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"(f,) = hub.fetch_files({PRETRAIN_REPO!r}, ['shard_00001.parquet'], cache_dir=Path('cache'), desc='probe')\n"
        "print(f.size)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=client_env(hub, tmp_path, CHATPIPE_PROGRESS_EVERY="0.000001"),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    size = int(proc.stdout.split()[-1])
    lines = [line for line in proc.stderr.splitlines() if "chatpipe.progress" in line and "probe: " in line]
    assert lines and f"probe: {size}/{size} B" in lines[-1], proc.stderr[-3000:]
