"""Files from a Hugging Face hub -- or a mirror at ``HF_ENDPOINT`` -- in huggingface_hub's own cache.

    files = fetch_files("karpathy/fineweb-edu-100b-shuffle", ["shard_00000.parquet"], cache_dir=Path("data/cache"))
    files[0].path, files[0].sha256, files[0].revision
    paths = dataset_split_files("openai/gsm8k", "main", "train", cache_dir=Path("data/cache"))

``cache_dir`` is a huggingface_hub cache (``datasets--<org>--<name>/``: blobs, snapshots, refs, per-file
locks); the client resumes dropped bodies and retries 429 itself. Added here: a cache lookup first (a
branch is resolved once), so a cached file costs no request, also with ``HF_HUB_OFFLINE=1``; backoff
for the rest (5xx, short or corrupt bodies; ``CHATPIPE_HUB_RETRIES``, default 5, ``CHATPIPE_HUB_BACKOFF_S``,
default 1 s, doubling up to 30), then a :class:`HubError` naming repo, file and revision (a missing repo
or file fails at once); each download checked against the hash its blob is named by (LFS: sha256, else
git blob sha1); byte progress through :mod:`chatpipe.progress`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from chatpipe.io import sha256_file
from chatpipe.progress import progress

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 30.0


class HubError(RuntimeError):
    """A hub file could not be fetched; the message names repo, file and revision."""

    def __init__(self, repo: str, file: str, revision: str, reason: str, repo_type: str = "dataset") -> None:
        self.repo, self.file, self.revision = repo, file, revision
        super().__init__(f"hub {repo_type} {repo!r}, file {file!r}, revision {revision!r}: {reason}")


class ChecksumMismatch(OSError):
    """A downloaded file's content differs from the hash the hub lists for it (retried)."""


@dataclass
class HubFile:
    """One cached file; ``path`` is its place in the cache's snapshot of ``revision``."""

    repo: str
    revision: str  # the commit the file was fetched at
    file: str
    size: int
    sha256: str
    path: str = ""

    def record(self) -> dict[str, Any]:
        """Provenance fields (no local path): identical on every machine that fetched the same file."""
        return {k: v for k, v in asdict(self).items() if k != "path"}


def retry_knobs() -> tuple[int, float]:
    """(retries, first backoff in s) from ``CHATPIPE_HUB_RETRIES`` / ``CHATPIPE_HUB_BACKOFF_S``."""
    try:
        retries = int(os.environ.get("CHATPIPE_HUB_RETRIES", "5"))
        backoff = float(os.environ.get("CHATPIPE_HUB_BACKOFF_S", "1.0"))
    except ValueError as e:
        raise ValueError(f"CHATPIPE_HUB_RETRIES / CHATPIPE_HUB_BACKOFF_S must be numbers: {e}") from None
    if retries < 0 or backoff < 0:
        raise ValueError(f"CHATPIPE_HUB_RETRIES ({retries}) and CHATPIPE_HUB_BACKOFF_S ({backoff}) must be >= 0")
    return retries, backoff


def is_transient(exc: BaseException | None) -> bool:
    """Worth retrying: 408/429/5xx, connection errors, short or corrupt bodies. A missing repo,
    revision or file, offline mode and other 4xx are permanent. The client reports a failed
    metadata request as "not found locally" caused by the real error, so causes are followed."""
    import httpx2
    from huggingface_hub import errors

    for _ in range(8):
        if exc is None or isinstance(exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
            return False
        if isinstance(exc, errors.HfHubHTTPError):
            return getattr(exc.response, "status_code", None) in RETRYABLE_STATUS
        if isinstance(exc, errors.LocalEntryNotFoundError):
            exc = exc.__cause__ or exc.__context__
            continue
        if isinstance(exc, (errors.EntryNotFoundError, errors.OfflineModeIsEnabled)):
            return False
        if isinstance(exc, (ChecksumMismatch, httpx2.TransportError, ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            return True  # the body was shorter than the size the hub announced
        exc = exc.__cause__
    return False


def with_retries(fn: Callable[[], T], *, repo: str, file: str, revision: str, repo_type: str = "dataset") -> T:
    """``fn()``, retried with backoff while it fails transiently; else a :class:`HubError` naming the file."""
    retries, backoff = retry_knobs()
    for attempt in range(retries + 1):
        try:
            return fn()
        except HubError:
            raise  # from a nested call: already names its file
        except Exception as e:  # classified here; anything permanent is re-raised as HubError at once
            error = f"{type(e).__name__}: {e}"
            if not is_transient(e) or attempt == retries:
                why = error if not is_transient(e) else f"gave up after {retries + 1} attempts; last error {error}"
                raise HubError(repo, file, revision, why, repo_type) from e
            wait = min(backoff * 2**attempt, MAX_BACKOFF_S)
            log.warning(
                "hub %s %s@%s: %s; retry %d/%d in %.1fs", repo, file, revision, error[:200], attempt + 1, retries, wait
            )
            time.sleep(wait)
    raise AssertionError("unreachable")


def _hub_file(repo: str, file: str, pointer: str, check: bool = False) -> HubFile:
    """A cached file's record: its snapshot folder is named by the commit, its blob by the hub's hash
    (LFS: the sha256, else the git blob sha1). ``check``: hash the blob against that name first, and
    remove it on a mismatch, so that the retry downloads it again."""
    from huggingface_hub.utils.sha import git_hash

    blob = Path(os.path.realpath(pointer))
    lfs = re.fullmatch(r"[0-9a-f]{64}", blob.name)
    sha256 = blob.name if lfs and not check else sha256_file(blob)
    if check and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", blob.name):  # else the etag is no hash: size only
        actual = sha256 if lfs else git_hash(blob.read_bytes())  # a plain git file is small (the hub's LFS cut)
        if actual != blob.name:
            blob.unlink(missing_ok=True)
            Path(pointer).unlink(missing_ok=True)
            raise ChecksumMismatch(f"checksum mismatch: {actual} != {blob.name}, the hash the hub lists")
    return HubFile(repo, Path(pointer).parents[file.count("/")].name, file, blob.stat().st_size, sha256, pointer)


def fetch_files(
    repo: str, files: list[str], *, cache_dir: Path, revision: str = "main", repo_type: str = "dataset", desc: str = ""
) -> list[HubFile]:
    """Fetch ``files`` of ``repo`` at ``revision`` into the cache (or find them there); in order of ``files``."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.hf_api import RepoFile

    where = {"revision": revision, "repo_type": repo_type}
    found = {f: try_to_load_from_cache(repo, f, cache_dir, **where) for f in files}
    missing = [f for f in files if not isinstance(found[f], str)]

    def sizes() -> dict[str, int]:
        return {i.path: i.size for i in HfApi().get_paths_info(repo, missing, **where) if isinstance(i, RepoFile)}

    def bars(**_: Any) -> contextlib.nullcontext:
        """Each bar the client opens is the batch's, in a no-op context: the batch closes it."""
        return contextlib.nullcontext(bar)

    def download(file: str) -> HubFile:
        """One attempt: the client's download into its cache, then the checksum of what came."""
        start = bar.n
        try:
            pointer = hf_hub_download(repo, file, cache_dir=cache_dir, tqdm_class=bars, **where)
            return _hub_file(repo, file, pointer, check=bar.n > start)  # not when a concurrent rank just did
        except BaseException:
            bar.update(start - bar.n)  # counted again by the next attempt
            raise

    if missing:
        listing = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        size = with_retries(sizes, repo=repo, file=listing, **where)
        for f in missing:
            if f not in size:
                raise HubError(repo, f, revision, "no such file in the repo at this revision", repo_type)
        with progress(sum(size.values()), desc or repo, unit="B") as bar:
            for f in missing:
                found[f] = with_retries(functools.partial(download, f), repo=repo, file=f, **where)
    return [found[f] if isinstance(found[f], HubFile) else _hub_file(repo, f, found[f]) for f in files]


def _config_patterns(readme: str, config: str | None, split: str) -> list[str] | None:
    """``data_files`` patterns of ``config``/``split`` in a dataset card (None: no such config), read as
    ``datasets`` reads them; ``config`` None takes the card's default or first config."""
    from datasets.data_files import sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    configs = MetadataConfigs.from_dataset_card_data(DatasetCard(readme).data)
    name = config if config is not None else (configs.get_default_config_name() or next(iter(configs), None))
    if name not in configs:
        return None
    data_files = configs[name].get("data_files")
    return list(sanitize_patterns(data_files).get(split, [])) if data_files else []


def _card_and_listing(repo: str, cache_dir: Path, revision: str) -> tuple[Path, list[str]]:
    """The snapshot folder with the repo's README.md (if it has one) and the repo's file list: from
    the cache when the client's tree listing of the ref's commit is there, else from the hub."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    def snapshot(local_files_only: bool) -> tuple[Path, list[str]]:
        at = {"repo_type": "dataset", "revision": revision, "cache_dir": cache_dir}
        root = snapshot_download(repo, allow_patterns=["README.md"], local_files_only=local_files_only, **at)
        if not local_files_only and (Path(root) / "README.md").is_file():  # checked as every download is
            _hub_file(repo, "README.md", str(Path(root) / "README.md"), check=True)
        return Path(root), sorted(f.path for f in get_cached_repo_tree(repo, **at))

    try:
        return snapshot(local_files_only=True)
    except (LocalEntryNotFoundError, CachedRepoTreeNotFoundError):
        return with_retries(lambda: snapshot(local_files_only=False), repo=repo, file="(file list)", revision=revision)


def dataset_split_files(
    repo: str, config: str | None, split: str, *, cache_dir: Path, revision: str = "main"
) -> list[Path]:
    """The cached data files of one split of a dataset config, fetched on first use: those the README's
    ``configs`` name (as the hub's viewer reads them), else ``[data/]<config>/<split>-*``, matched
    against the client's cached tree listing, so a second call makes no request."""
    root, listed = _card_and_listing(repo, Path(cache_dir), revision)
    card = root / "README.md"
    patterns = _config_patterns(card.read_text(encoding="utf-8"), config, split) if card.is_file() else None
    if patterns is None:
        patterns = [f"{config}/{split}-*", f"data/{config}/{split}-*"] if config else [f"{split}-*", f"data/{split}-*"]
    names = [f for f in listed if any(fnmatch.fnmatch(f, p) for p in patterns)]
    if not names:
        why = f"no data files for config {config!r}, split {split!r} (patterns {patterns}; files: {listed[:20]})"
        raise HubError(repo, f"{config}/{split}", revision, why)
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
