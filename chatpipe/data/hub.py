"""Files from a Hugging Face hub -- or a mirror at ``HF_ENDPOINT`` -- retried, verified, cached, recorded.

    files = fetch_files("karpathy/fineweb-edu-100b-shuffle", ["shard_00000.parquet"], cache_dir=Path("data/cache"))
    files[0].path, files[0].sha256, files[0].revision
    paths = dataset_split_files("openai/gsm8k", "main", "train", cache_dir=Path("data/cache"))

Downloads go through the unmodified ``huggingface_hub`` client; an air-gapped site points
``HF_ENDPOINT`` at its mirror and nothing else changes. The client does the transfer: its own
retries of dropped connections and 408/429, its Range resume of a broken body, and its checksum
check (``HfApi.verify_repo_checksums``: the hub's sha256 for LFS files, the git blob sha1
otherwise). The ``datasets`` library reads a dataset card's ``configs``. What this module adds:

- exponential backoff (429 honours ``Retry-After``) around every call, for what the client does
  not retry itself (5xx, metadata and listing requests, a file that fails its checksum); after
  the last retry a :class:`HubError` names the repo, file and revision. Missing repos/files fail at once.
- a file reaches ``cache_dir/<org>__<name>/<file>`` only once it verified: the client downloads
  it into ``.staging/<org>__<name>`` (its ``local_dir``), and that whole directory, with the
  client's partial files and metadata in it, is removed after each fetch. Nothing inside the
  client's own layout is touched; a file that failed its checksum is downloaded again with
  ``force_download``. No partial or corrupt file is ever in the cache.
- ``cache_dir/hub_manifest.json`` records each file fetched: repo, requested and resolved
  revision, file, size, sha256. A file in the manifest whose cached copy has the recorded size is
  used without any request, so a second run transfers nothing. A branch name (``main``) is
  resolved once; delete the cache (or pin a commit) to pick up newer commits.
- byte progress of each batch through :mod:`chatpipe.progress` (a bar on a terminal, else a
  throttled log line, so CI, torchx and Prefect logs show it too).

Retry knobs (environment, read per call): ``CHATPIPE_HUB_RETRIES`` (default 5 retries after the
first try) and ``CHATPIPE_HUB_BACKOFF_S`` (default 1.0: waits 1, 2, 4, ... s, at most 30).
"""

from __future__ import annotations

import fcntl
import fnmatch
import functools
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from chatpipe.io import move_into_place, sha256_file, write_text_atomic
from chatpipe.progress import Progress, progress

log = logging.getLogger(__name__)
T = TypeVar("T")

MANIFEST = "hub_manifest.json"
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 30.0


class HubError(RuntimeError):
    """A hub file could not be fetched; the message names repo, file and revision."""

    def __init__(self, repo: str, file: str, revision: str, reason: str, repo_type: str = "dataset") -> None:
        self.repo, self.file, self.revision = repo, file, revision
        super().__init__(f"hub {repo_type} {repo!r}, file {file!r}, revision {revision!r}: {reason}")


class ChecksumMismatch(OSError):
    """A downloaded file's size or checksum differs from what the hub lists for it (retried)."""


@dataclass
class HubFile:
    """One fetched file as recorded in the manifest; ``path`` is its place in the cache."""

    repo: str
    revision: str  # the commit the file was fetched at
    file: str
    size: int
    sha256: str
    requested_revision: str = "main"
    repo_type: str = "dataset"
    path: str = ""

    def record(self) -> dict[str, Any]:
        """The manifest fields (no local path): identical on every machine that fetched the same file."""
        return {
            "repo": self.repo,
            "revision": self.revision,
            "file": self.file,
            "size": self.size,
            "sha256": self.sha256,
        }


# ---------------------------------------------------------------------- retries


def _retry_knobs() -> tuple[int, float]:
    try:
        retries = int(os.environ.get("CHATPIPE_HUB_RETRIES", "5"))
        backoff = float(os.environ.get("CHATPIPE_HUB_BACKOFF_S", "1.0"))
    except ValueError as e:
        raise ValueError(f"CHATPIPE_HUB_RETRIES / CHATPIPE_HUB_BACKOFF_S must be numbers: {e}") from None
    if retries < 0 or backoff < 0:
        raise ValueError(f"CHATPIPE_HUB_RETRIES ({retries}) and CHATPIPE_HUB_BACKOFF_S ({backoff}) must be >= 0")
    return retries, backoff


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: 408/429/5xx, connection and protocol errors, short or corrupt bodies.

    A missing repo, revision or file (and any other 4xx) is permanent. huggingface_hub reports a
    failed metadata request as "not found locally" with the real error as its cause, so causes
    are followed.
    """
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    seen = 0
    while exc is not None and seen < 8:
        seen += 1
        if isinstance(exc, ChecksumMismatch):
            return True
        if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
            return False
        if isinstance(exc, HfHubHTTPError):
            return _status(exc) in RETRYABLE_STATUS
        if isinstance(exc, LocalEntryNotFoundError):
            exc = exc.__cause__ or exc.__context__
            continue
        if isinstance(exc, EntryNotFoundError):
            return False
        if isinstance(exc, (*_transport_errors(), ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            return True  # the body was shorter than the size the hub announced
        exc = exc.__cause__
    return False


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level error bases of the HTTP clients in use: huggingface_hub 2.4 uses httpx2, older ones httpx."""
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(__import__(name).TransportError)
        except ImportError:
            pass
    return tuple(found)


def _delay(exc: BaseException, attempt: int, backoff: float) -> float:
    wait = min(backoff * 2**attempt, MAX_BACKOFF_S)
    cause: BaseException | None = exc
    while cause is not None:
        response = getattr(cause, "response", None)
        retry_after = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
        if retry_after:
            try:
                return min(max(float(retry_after), wait), MAX_BACKOFF_S)
            except ValueError:
                break  # an HTTP date: keep our own backoff
        cause = cause.__cause__ or cause.__context__
    return wait


def with_retries(fn: Callable[[], T], *, repo: str, file: str, revision: str, repo_type: str = "dataset") -> T:
    """``fn()``, retried with backoff while it fails transiently; else a :class:`HubError` naming the file."""
    retries, backoff = _retry_knobs()
    for attempt in range(retries + 1):
        try:
            return fn()
        except HubError:
            raise  # from a nested call: already names its file
        except Exception as e:  # classified below; anything permanent is re-raised as HubError at once
            if not is_transient(e):
                raise HubError(repo, file, revision, f"{type(e).__name__}: {e}", repo_type) from e
            if attempt == retries:
                raise HubError(
                    repo,
                    file,
                    revision,
                    f"gave up after {retries + 1} attempts; last error {type(e).__name__}: {e}",
                    repo_type,
                ) from e
            wait = _delay(e, attempt, backoff)
            log.warning(
                "hub %s %s@%s: %s: %s; retry %d/%d in %.1fs",
                repo,
                file,
                revision,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
                attempt + 1,
                retries,
                wait,
            )
            time.sleep(wait)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- cache + manifest


def repo_dir(cache_dir: Path, repo: str) -> Path:
    """Where ``repo``'s verified files live: ``cache_dir/<org>__<name>``."""
    return Path(cache_dir) / repo.replace("/", "__")


@contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    """One fetch at a time per cache (ranks of one stage share it)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".hub.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_manifest(cache_dir: Path) -> dict[str, Any]:
    """The cache's manifest: ``{"files": {key: record}, "splits": {key: [file, ...]}}``."""
    path = Path(cache_dir) / MANIFEST
    if not path.is_file():
        return {"files": {}, "splits": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it to fetch again") from None
    return {"files": data.get("files", {}), "splits": data.get("splits", {})}


def _write_manifest(cache_dir: Path, manifest: dict[str, Any]) -> None:
    path = Path(cache_dir) / MANIFEST
    write_text_atomic(path, json.dumps(manifest, indent=1, sort_keys=True))


def _key(repo_type: str, repo: str, revision: str, file: str) -> str:
    return f"{repo_type}:{repo}@{revision}:{file}"


def _cached(cache_dir: Path, manifest: dict, repo_type: str, repo: str, revision: str, file: str) -> HubFile | None:
    rec = manifest["files"].get(_key(repo_type, repo, revision, file))
    if rec is None:
        return None
    path = repo_dir(cache_dir, repo) / file
    if not path.is_file() or path.stat().st_size != rec["size"]:
        return None
    return HubFile(**{**rec, "path": str(path)})


# ---------------------------------------------------------------------- fetching


def resolve_revision(repo: str, revision: str = "main", repo_type: str = "dataset") -> str:
    """The commit sha that ``revision`` (a branch, tag or sha) points at on the hub.

    The client's ``HfApi.resolve_revision`` (a sha is returned as is; it asks with the explicit
    revision, which mirrors such as olah 0.5.4 need); a hub that answers 5xx surfaces as its
    ``RevisionResolutionError`` caused by the 5xx, which is retried here.
    """
    from huggingface_hub import HfApi

    resolved = with_retries(
        lambda: HfApi().resolve_revision(repo, repo_type=repo_type, revision=revision),
        repo=repo,
        file="(repo info)",
        revision=revision,
        repo_type=repo_type,
    )
    return resolved.resolved


def fetch_files(
    repo: str,
    files: list[str],
    *,
    cache_dir: Path,
    revision: str = "main",
    repo_type: str = "dataset",
    desc: str | None = None,
) -> list[HubFile]:
    """Fetch ``files`` of ``repo`` at ``revision`` into the cache (or find them there); in order of ``files``."""
    cache_dir = Path(cache_dir)
    with _locked(cache_dir):
        manifest = read_manifest(cache_dir)
        found = {f: _cached(cache_dir, manifest, repo_type, repo, revision, f) for f in files}
        missing = [f for f in files if found[f] is None]
        if missing:
            found.update(_download(repo, missing, cache_dir, manifest, revision, repo_type, desc))
    return [found[f] for f in files]


def _download(
    repo: str, files: list[str], cache_dir: Path, manifest: dict, revision: str, repo_type: str, desc: str | None
) -> dict[str, HubFile]:
    from huggingface_hub import HfApi

    commit = resolve_revision(repo, revision, repo_type)
    infos = with_retries(
        lambda: HfApi().get_paths_info(repo, files, revision=commit, repo_type=repo_type),
        repo=repo,
        file=", ".join(files[:3]) + (" ..." if len(files) > 3 else ""),
        revision=revision,
        repo_type=repo_type,
    )
    by_path = {i.path: i for i in infos}
    for f in files:
        if f not in by_path or not hasattr(by_path[f], "size"):
            raise HubError(repo, f, revision, f"no such file at commit {commit}", repo_type)
    staging = cache_dir / ".staging" / repo.replace("/", "__")
    out: dict[str, HubFile] = {}
    try:
        with progress(sum(by_path[f].size for f in files), desc or repo, unit="B") as bar:
            for f in files:
                out[f] = _download_one(repo, f, by_path[f], cache_dir, staging, (revision, commit), repo_type, bar)
                manifest["files"][_key(repo_type, repo, revision, f)] = {
                    k: v for k, v in asdict(out[f]).items() if k != "path"
                }
                _write_manifest(cache_dir, manifest)
    finally:
        # Our staging dir as a whole, the client's partial files and metadata with it: a failed
        # fetch leaves nothing half-done, and a finished one nothing the client could trust later.
        shutil.rmtree(staging, ignore_errors=True)
    return out


class _Bytes:
    """What huggingface_hub's download calls as its ``tqdm_class``: its byte counts (including
    its own roll-back when a server ignores a Range request) go to the batch's one progress."""

    def __init__(self, target: Progress, **_: Any) -> None:
        self.target = target

    def update(self, n: int = 1) -> None:
        self.target.update(n)

    def close(self) -> None:
        pass

    def __enter__(self) -> _Bytes:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _download_one(
    repo: str, file: str, info: Any, cache_dir: Path, staging: Path, revs: tuple[str, str], repo_type: str, bar
) -> HubFile:
    """Download ``file`` at the commit into ``staging``, verify it with the client, move it into the cache.

    ``verify_repo_checksums`` lists the repo's tree at the commit (a few paged API requests even for
    a repo of thousands of files) and hashes what is in ``staging``: only this file, since each
    verified file leaves it at once.
    """
    from huggingface_hub import HfApi, hf_hub_download

    revision, commit = revs
    failed_check = False

    def attempt() -> HubFile:
        nonlocal failed_check
        # local_dir keeps the client's own partial file across our retries, so it can resume; after
        # a checksum failure force_download makes it fetch again instead of trusting its copy.
        staged = hf_hub_download(
            repo,
            file,
            repo_type=repo_type,
            revision=commit,
            local_dir=staging,
            force_download=failed_check,
            tqdm_class=functools.partial(_Bytes, bar),
        )
        check = HfApi().verify_repo_checksums(repo, repo_type=repo_type, revision=commit, local_dir=staging)
        wrong = [m for m in check.mismatches if m["path"] == file]
        if wrong or file in check.missing_paths:
            failed_check = True
            bar.update(-info.size)  # counted again by the next attempt
            m = wrong[0] if wrong else {"algorithm": "file", "actual": "missing", "expected": "present"}
            raise ChecksumMismatch(
                f"checksum mismatch: {m['algorithm']} {m['actual']} != {m['expected']} listed by the hub"
            )
        final = repo_dir(cache_dir, repo) / file
        move_into_place(staged, final)  # out of staging: the next file's check hashes only that one
        # verified, so an LFS file's sha256 is the hub's; a plain git file was checked by blob sha1
        sha256 = info.lfs.sha256 if getattr(info, "lfs", None) else sha256_file(final)
        return HubFile(repo, commit, file, final.stat().st_size, sha256, revision, repo_type, str(final))

    return with_retries(attempt, repo=repo, file=file, revision=revision, repo_type=repo_type)


# ---------------------------------------------------------------------- dataset configs and splits


def _config_patterns(readme: str, config: str | None, split: str) -> list[str] | None:
    """``data_files`` patterns of ``config``/``split`` from a dataset card (None: the card declares no such config).

    Read the way ``datasets`` reads it (its ``MetadataConfigs`` and ``sanitize_patterns``: bare
    patterns are one ``train`` split); ``config`` None takes the card's default or first config.
    """
    from datasets.data_files import sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    configs = MetadataConfigs.from_dataset_card_data(DatasetCard(readme).data)
    name = config if config is not None else (configs.get_default_config_name() or next(iter(configs), None))
    if name not in configs:
        return None
    data_files = configs[name].get("data_files")
    return list(sanitize_patterns(data_files).get(split, [])) if data_files else []


def dataset_split_files(
    repo: str, config: str | None, split: str, *, cache_dir: Path, revision: str = "main"
) -> list[Path]:
    """The cached data files of one split of a dataset config, fetched on first use.

    Files are chosen as the hub's dataset viewer does: the ``configs`` section of the repo's
    README.md (``data_files`` patterns per split), else the conventional ``<config>/<split>-*`` or
    ``data/<config>/<split>-*`` names. The choice is remembered in the manifest, so a second call
    makes no request.
    """
    cache_dir = Path(cache_dir)
    key = _key("dataset", repo, revision, f"{config}/{split}")
    names = read_manifest(cache_dir)["splits"].get(key)
    if names is None:
        from huggingface_hub import HfApi

        listed = with_retries(
            lambda: HfApi().list_repo_files(repo, revision=resolve_revision(repo, revision), repo_type="dataset"),
            repo=repo,
            file="(file list)",
            revision=revision,
        )
        patterns = None
        if "README.md" in listed:
            (card,) = fetch_files(repo, ["README.md"], cache_dir=cache_dir, revision=revision)
            patterns = _config_patterns(Path(card.path).read_text(encoding="utf-8"), config, split)
        if patterns is None:
            patterns = (
                [f"{config}/{split}-*", f"data/{config}/{split}-*"] if config else [f"{split}-*", f"data/{split}-*"]
            )
        names = sorted(f for f in listed if any(fnmatch.fnmatch(f, p) for p in patterns))
        if not names:
            raise HubError(
                repo,
                f"{config}/{split}",
                revision,
                f"no data files for config {config!r}, split {split!r} (patterns {patterns}; files: {listed[:20]})",
            )
        with _locked(cache_dir):
            manifest = read_manifest(cache_dir)
            manifest["splits"][key] = names
            _write_manifest(cache_dir, manifest)
    fetched = fetch_files(repo, names, cache_dir=cache_dir, revision=revision, desc=f"{repo} {config}/{split}")
    return [Path(f.path) for f in fetched]


def default_cache_dir() -> Path:
    """The hub cache of task loaders: ``$CHATPIPE_HUB_CACHE``, else ``data/cache`` (the data stage's default)."""
    return Path(os.environ.get("CHATPIPE_HUB_CACHE", "data/cache"))


def parse_hf_url(url: str) -> tuple[str, str, str, str]:
    """``hf://datasets/<org>/<name>[@rev]/<path>`` -> (repo_type, repo, revision, path)."""
    m = re.match(r"^hf://(datasets|models|spaces)/([^/@]+/[^/@]+)(?:@([^/]+))?/(.+)$", url)
    if not m:
        raise ValueError(f"{url!r}: expected hf://datasets/<org>/<name>[@revision]/<path in repo>")
    kind, repo, rev, path = m.groups()
    return kind[:-1], repo, rev or "main", path
