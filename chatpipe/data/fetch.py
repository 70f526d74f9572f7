"""Fetching a zipped data bundle (the CORE eval bundle) into place, all or nothing.

``hf://datasets/<org>/<name>[@rev]/<file>.zip`` URLs go through :mod:`chatpipe.data.hub` (the hub
or the ``HF_ENDPOINT`` mirror: retried, checksum verified, in the hub cache); any other fsspec URL
is read with fsspec, retried with backoff, and its zip CRCs checked before unpacking.
"""

from __future__ import annotations

import logging
import shutil
import time
import zipfile
from pathlib import Path

import fsspec

from chatpipe.data import hub
from chatpipe.io import atomic_dir, move_into_place

log = logging.getLogger(__name__)


def fetch_zip(url: str, dest: Path) -> Path:
    """Download the zip at ``url`` (an fsspec URL: https, file; s3/gs with s3fs/gcsfs) and unpack it as ``dest``.

    A zip holding one top-level folder is unpacked as that folder's contents. Everything happens
    in :func:`chatpipe.io.atomic_dir`'s temp dir beside ``dest``, renamed into place at the end, so an
    interrupted or failed fetch leaves no half-written ``dest``. An existing ``dest`` is kept as it is.
    """
    dest = Path(dest)
    if dest.is_dir():
        return dest
    try:
        with atomic_dir(dest) as work:
            if url.startswith("hf://"):
                repo_type, repo, revision, path = hub.parse_hf_url(url)
                (got,) = hub.fetch_files(
                    repo, [path], cache_dir=hub.default_cache_dir(), revision=revision, repo_type=repo_type
                )
                archive = Path(got.path)
            else:
                archive = work / ".bundle.zip"
                _download_checked(url, archive)
            _unpack(archive, work)
    except hub.HubError:
        raise  # already names repo, file and revision
    except Exception as e:  # network, storage and archive errors alike: say what and where
        raise RuntimeError(f"could not fetch {url} into {dest}: {e}") from e
    return dest


def _unpack(archive: Path, work: Path) -> None:
    """Unpack ``archive`` so that ``work`` holds its files, or those of its one top-level folder."""
    unpacked = work / ".unpacked"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(unpacked)  # zipfile drops absolute paths and '..' from member names
    entries = [p for p in unpacked.iterdir() if p.name != "__MACOSX"]
    root = entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked
    for entry in root.iterdir():
        if entry.name != "__MACOSX":
            move_into_place(entry, work / entry.name)  # inside the atomic work dir
    shutil.rmtree(unpacked)
    if archive.parent == work:
        archive.unlink()  # our download; a hub archive stays in the hub cache


def _download_checked(url: str, archive: Path) -> None:
    """Copy ``url`` to ``archive`` and check every member's CRC; retried with backoff (same knobs as the hub)."""
    retries, backoff = hub.retry_knobs()
    if fsspec.utils.get_protocol(url) in ("file", "local"):
        retries = 0  # a local file does not get better by waiting
    for attempt in range(retries + 1):
        try:
            with fsspec.open(url, "rb") as src, open(archive, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
            with zipfile.ZipFile(archive) as zf:
                bad = zf.testzip()
            if bad is not None:
                raise zipfile.BadZipFile(f"CRC mismatch in member {bad}")
            return
        except Exception as e:  # fsspec raises OSError, ValueError or aiohttp errors by protocol
            archive.unlink(missing_ok=True)
            if attempt == retries or isinstance(e, FileNotFoundError):
                raise RuntimeError(
                    f"{url}: gave up after {retries + 1} attempts; last error {type(e).__name__}: {e}"
                ) from e
            wait = min(backoff * 2**attempt, hub.MAX_BACKOFF_S)
            log.warning("fetch %s: %s: %s; retry %d/%d in %.1fs", url, type(e).__name__, e, attempt + 1, retries, wait)
            time.sleep(wait)
