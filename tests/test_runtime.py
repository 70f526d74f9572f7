"""chatpipe.runtime: the CPU allocator setting that training steps rely on, and the frozen startup heap
that long-lived serving processes rely on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from chatpipe.runtime import cpu_multiplies_bf16, keep_freed_memory_in_heap
from chatpipe.testing.cpu_allocator import run


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_training_steps_stop_faulting_pages_back_in():
    # d1 steps at vocab 4096, each setting in its own process (mallopt is process-wide and
    # one-way): the logits (16 x 256 x 4096 fp32, 64 MB) exceed the largest mmap threshold
    # glibc picks by itself (32 MB), so its default maps and faults them in again every step;
    # kept in the heap, later steps reuse them. "kept" fails if the setting was not applied.
    # (The logits set the faults, not the depth: the bench's d4 costs 3x the CPU for the same check.)
    # A kept heap still grows by one 64 MB top pad now and then while it settles (its free blocks
    # fragment): up to two of the first eight steps in 30-step traces. The median of eight
    # steps reads the settled step; the median of four read a growing one in CI once.
    default, kept = run("default", 4096, steps=8, depth=1), run("kept", 4096, steps=8, depth=1)
    assert default["faults"] > 2000
    assert kept["faults"] < default["faults"] / 10


def test_users_malloc_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory_in_heap() is False


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu avx2 avx512f avx512_bf16 avx512_vnni", True),
        ("fpu avx2 amx_bf16 amx_tile", True),
        ("fpu avx2 avx512f", False),
    ],
)
def test_cpu_bf16_dot_products_are_read_from_the_kernels_flags(tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    )
    assert cpu_multiplies_bf16(str(cpuinfo)) is native
    assert cpu_multiplies_bf16(str(tmp_path / "absent")) is False  # no /proc (macOS, Windows): float32


@pytest.mark.parametrize(("isa", "native"), [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True)])
def test_a_onednn_isa_cap_below_bf16_means_no_bf16(tmp_path, monkeypatch, isa, native):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes an AVX-512 + bf16 machine run the AVX2 kind's kernels: no bf16 there."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert cpu_multiplies_bf16(str(cpuinfo)) is native


@pytest.mark.parametrize(
    "capability, cache_dir, expected",
    [
        ("", None, "{default}"),  # no capability: inductor's own default
        ("avx2", None, "{default}-avx2"),
        ("AVX2", "{default}", "{default}-avx2"),  # a default inductor wrote into the environment
        ("avx2", "/somewhere/mine", "/somewhere/mine"),  # the user's own choice stays
    ],
)
def test_compile_keeps_inductor_caches_apart_per_cpu_capability(monkeypatch, capability, cache_dir, expected):
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from chatpipe import runtime

    default = default_cache_dir()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    if cache_dir is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir.format(default=default))
    compiled = runtime.compile(lambda x: x + 1)  # torch.compile compiles lazily: nothing runs here
    assert callable(compiled)
    assert inductor_cache_dir() == expected.format(default=default)


FREEZE_CHECK = textwrap.dedent("""
    import gc, json, weakref
    import torch  # startup's objects: what a serving process holds for its whole life
    from chatpipe.runtime import freeze_startup_heap
    gc.collect()
    before = len(gc.get_objects(generation=2))
    frozen = freeze_startup_heap()
    after = len(gc.get_objects(generation=2))

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle made after the freeze: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    print(json.dumps({"before": before, "frozen": frozen, "after": after, "cycle_freed": gone() is None}))
""")


def test_freezing_the_startup_heap_leaves_full_collections_nothing_of_startup_and_later_cycles_are_still_freed():
    # in a process of its own: gc.freeze is process-wide. Before, a full collection in the server and
    # its batch process walked every startup object (~200k with torch), pausing every stream ~0.1 s
    import json

    out = subprocess.run([sys.executable, "-c", FREEZE_CHECK], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["before"] > 50_000 and got["frozen"] > 0.9 * got["before"], got
    assert got["after"] < got["before"] / 100, got  # what a full collection still walks
    assert got["cycle_freed"], got
