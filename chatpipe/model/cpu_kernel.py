"""The C kernel a decode step's attention runs on CPU: keys and values read in place from the paged pool.

A decode step of the engine attends each row's one query over its keys. Done with torch ops, every
layer first gathers every row's keys and values out of their blocks into one padded buffer (a copy
of megabytes), then runs about twenty small ops over it; on a CPU that is most of a small model's
decode step. ``paged_attention.c`` instead reads each key where it lies, once, in one call per layer
(threads over rows and heads, as many as torch's, on torch's own OpenMP pool).

It is compiled on first use with the system's C compiler (``$CC``, else ``cc``), for this CPU
(``-march=native``), into ``$CHATPIPE_KERNEL_CACHE`` (default ``~/.cache/chatpipe/kernels``) under a
name that hashes the source, the flags and the CPU, so a machine never loads another's build. It
takes about a second. Where no compiler is found or the build fails, a warning names the cause and
decode attention stays on torch ops (:class:`chatpipe.model.paged_cache.PagedBatch`'s gathers), as
it does with ``CHATPIPE_PAGED_KERNEL=0``. Results agree with the torch path to float32 rounding
(the sums run in another order), not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from chatpipe.io import move_into_place

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
# no -ffast-math: linking it into a shared library sets flush-to-zero for the whole process. The
# reassociation alone lets the compiler vectorize the dot products.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros"]
FLAGS += ["-fassociative-math", "-shared", "-fPIC"]
ENABLE_ENV = "CHATPIPE_PAGED_KERNEL"  # "0": decode attention on torch ops


def cache_dir() -> Path:
    given = os.environ.get("CHATPIPE_KERNEL_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chatpipe" / "kernels"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def build(compiler: str | None = None) -> Path:
    """The kernel's shared library for this CPU, compiled unless a build of the same source, flags and
    CPU is cached. Raises RuntimeError naming the compiler and its error when it cannot be built."""
    cc = compiler or os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (set $CC)")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([path, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_attention-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built in a directory of its own and moved in: processes that build at once never load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [path, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=120
        )
        if done.returncode:
            raise RuntimeError(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-800:]}")
        move_into_place(built, target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        log.warning("decode attention runs on torch ops: the paged-attention kernel is unavailable (%s)", err)
        return None
    fn = lib.paged_decode_attention
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    return lib


def available(device: torch.device) -> bool:
    """Whether decode attention on ``device`` can run in the kernel (CPU, and it builds here)."""
    return device.type == "cpu" and os.environ.get(ENABLE_ENV, "1") != "0" and _library() is not None


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    max_length: int,
    window: int | None,
) -> torch.Tensor:
    """[rows, heads, dim]: each row's query ``q`` [rows, heads, dim] over positions 0 .. ``lengths[r]``
    - 1 of its blocks ``tables`` [rows, width] (int64) in one pool layer ``k``/``v`` [kv_heads, blocks,
    block_size, dim], its last ``window`` keys only unless None; float32, scaled by 1/sqrt(dim)."""
    fn = _library().paged_decode_attention
    q = q.contiguous()
    rows, heads, dim = q.shape
    kv_heads, blocks, block_size, _ = k.shape
    out = torch.empty_like(q)
    fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
        rows, heads, kv_heads, dim, blocks, block_size, tables.size(1), max_length, window or 0,
        dim**-0.5, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
