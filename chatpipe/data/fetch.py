"""Fetching a zipped data bundle (the CORE eval bundle) into place, all or nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import fsspec

from chatpipe.progress import progress


def fetch_zip(url: str, dest: Path) -> Path:
    """Download the zip at ``url`` (an fsspec URL: https, file; s3/gs with s3fs/gcsfs) and unpack it as ``dest``.

    A zip holding one top-level folder is unpacked as that folder's contents. Everything happens
    in a temp dir beside ``dest`` and is renamed into place at the end, so an interrupted or failed
    fetch leaves no half-written ``dest``. An existing ``dest`` is kept as it is.
    """
    dest = Path(dest)
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        archive = work / "bundle.zip"
        with fsspec.open(url, "rb") as src, open(archive, "wb") as out:
            size = getattr(src, "size", None)  # known for http(s) with Content-Length, local files, s3/gs
            with progress(size, f"fetch {dest.name}", unit="B") as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        unpacked = work / "unpacked"
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(unpacked)  # zipfile drops absolute paths and '..' from member names
        entries = [p for p in unpacked.iterdir() if p.name != "__MACOSX"]
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked
        os.replace(root, dest)
    except Exception as e:  # network, storage and archive errors alike: say what and where
        raise RuntimeError(f"could not fetch {url} into {dest}: {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
