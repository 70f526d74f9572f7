"""Process runtime for stages: distributed init, device and precision, logging, cleanup.

Every stage enters through :func:`run_stage` (the single-process ones with ``distributed=False``),
so every stage validates params.yaml first and unwinds on SIGTERM. A stage runs the same under ``python -m stages.x`` (one process) and under torchrun/torchx
(``RANK``/``WORLD_SIZE`` set): :func:`init` reads the environment torchrun provides.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not here: the single-process stages that need no tensors (data)
# start ~1 s sooner without it, once per pipeline run and per test that runs them.


@dataclass
class Runtime:
    """Who this process is and where it computes."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def shard(self) -> dict[str, Any]:
        """``rank``, ``world_size`` and ``device`` as keyword arguments: what the row loaders need to
        give this rank its own rows on its own device."""
        return {"rank": self.rank, "world_size": self.world_size, "device": self.device}

    def autocast(self):
        """bf16 autocast on GPU; a no-op context in fp32."""
        import torch

        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


# ONEDNN_MAX_CPU_ISA values at or above the first ISA with bf16 dot products (and "no cap")
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")


def cpu_multiplies_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16), read from
    the kernel's CPU flags. There oneDNN's bf16 matmul runs 2-3x faster than fp32; without them torch
    emulates bf16 and it is slower. False where the flags cannot be read (other OSes), and where
    ``ONEDNN_MAX_CPU_ISA`` caps oneDNN below bf16 (``AVX2``: how an AVX-512 machine stands in for an
    AVX2-only one, whose kernels it then runs)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and not isa.startswith(ONEDNN_BF16_ISAS):
        return False
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compile(fn: Any, **kwargs: Any) -> Any:
    """``torch.compile(fn, **kwargs)``, with inductor's on-disk cache kept apart per ATen CPU capability.

    ``ATEN_CPU_CAPABILITY=avx2`` makes an AVX-512 machine compute like the AVX2 kind, and inductor
    then generates AVX2 kernels; but its cache key leaves the capability out, so a graph compiled
    under one capability is loaded under the other. Loaded that way, the compiled optimizer stepped
    18% away from nanochat's reference (AVX-512 kernels under avx2), or the process crashed (the
    other way round). A run under a capability gets its own cache directory instead.
    """
    import torch

    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if capability:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = default_cache_dir()
        # inductor writes its default back into the environment, so an inherited default counts as unset
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"
    return torch.compile(fn, **kwargs)


# --------------------------------------------------------------------------- intra-op threads
# Every process chatpipe starts gets an explicit intra-op thread count, its share of the cores it may
# use: processes that each take torch's default (every core) oversubscribe the machine as soon as two
# run at once. Two sweep points of 2 threads each on 2 cores trained 10-19x slower than with 1 each.
CORES_ENV = "CHATPIPE_CORES"  # the cores a launch may use, when it shares the machine (a sweep point)
_THREADS: dict[str, Any] = {}  # what :func:`use_threads` chose in this process, for the stage's MLflow params


def usable_cores() -> int:
    """The CPUs this process may use: the Slurm job's ``SLURM_CPUS_PER_TASK``, else the CPU affinity
    mask (what ``taskset``, cgroups' cpusets and container runtimes restrict), else every CPU."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        return int(slurm)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_share(cores: int, sharers: int) -> int:
    """One sharer's intra-op threads when ``sharers`` processes (or engine threads) split ``cores``: at least 1."""
    return max(1, cores // max(1, sharers))


def user_threads(env: dict[str, str] | None = None) -> int | None:
    """The count a user set with ``OMP_NUM_THREADS`` (its first level: ``4,2`` is 4), None when unset.
    A value that is no positive integer is an error naming the variable."""
    value = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r}: expected a positive integer (e.g. 1, 4), or unset it")
    return int(first)


def choose_threads(
    sharers: int = 1, *, setting: int = 0, cores: int | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """The intra-op thread count of one of ``sharers`` processes on ``cores``, and why.

    A user's ``OMP_NUM_THREADS`` wins, then a ``threads`` setting above 0 (``launch.threads``), then
    the share: ``cores`` (default :func:`usable_cores`) divided by ``sharers``, at least 1.
    """
    user = user_threads(env)
    if user is not None:
        return user, "OMP_NUM_THREADS"
    if setting > 0:
        return setting, "launch.threads"
    cores = usable_cores() if cores is None else cores
    return thread_share(cores, sharers), f"{cores} cores / {max(1, sharers)}"


def use_threads(count: int, why: str) -> int:
    """Make this process compute with ``count`` intra-op threads and log it.

    ``OMP_NUM_THREADS`` is set for a torch imported later (and for child processes); a torch already
    imported is told directly. The count becomes the stage's ``runtime/threads`` MLflow param.
    """
    if os.environ.get("OMP_NUM_THREADS") != str(count):
        os.environ["OMP_NUM_THREADS"] = _THREADS["wrote"] = str(count)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(count)
    _THREADS.update(count=count, why=why)
    logging.getLogger(__name__).info("intra-op threads: %d (%s)", _threads_now(), why)
    return count


def _threads_now() -> int:
    """The intra-op threads torch computes with now (the count chosen, where torch is not imported yet)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else _THREADS["count"]


def thread_params() -> dict[str, int]:
    """``{"runtime/threads": n}``, read from torch, once :func:`use_threads` ran in this process, else nothing."""
    return {"runtime/threads": _threads_now()} if "count" in _THREADS else {}


def share_cores(sharers: int) -> int:
    """Give this process's threads their share when ``sharers`` of them compute at once over one model
    (the serve engine pool: engines x threads <= cores). A user's ``OMP_NUM_THREADS`` or
    ``launch.threads`` still wins. Threads started later take torch's count as it is now."""
    return use_threads(*_chosen(sharers))


def _chosen(sharers: int) -> tuple[int, str]:
    from chatpipe.settings import LaunchSettings, ParamsError, load_section

    env = dict(os.environ)
    if "wrote" in _THREADS and env.get("OMP_NUM_THREADS") == _THREADS["wrote"]:
        del env["OMP_NUM_THREADS"]  # this process's own earlier choice, not the user's
    try:
        return choose_threads(sharers, setting=load_section(LaunchSettings).threads, env=env)
    except ValueError as e:
        raise ParamsError(str(e)) from None


def stage_threads() -> int:
    """A stage process's threads: what its launcher chose (``OMP_NUM_THREADS``), else ``launch.threads``,
    else the cores it may use shared among the workers on its node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return use_threads(*_chosen(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def setup_logging(rank: int = 0) -> None:
    """Plain timestamped logs; non-zero ranks only log warnings."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )


def init(device: str = "auto", dtype: str = "auto", *, training: bool = False) -> Runtime:
    """Initialise the process group if launched by torchrun and pick device and dtype.

    ``dtype: auto`` is bfloat16 autocast on GPU (nanochat's choice). On CPU it is bfloat16 for
    ``training`` where the CPU multiplies bf16 natively (AVX512-BF16, AMX): there the tiny step runs
    ~1.6x faster than in float32 (bench/README.md). Elsewhere, and for evaluation and serving
    (whose numbers must not depend on the CPU kind), float32.
    """
    import torch
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but CUDA is not available on this machine")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        # TF32 matmuls are safe for training at these scales and much faster on Ampere+.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        dev = torch.device("cpu")
        keep_freed_memory_in_heap()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    setup_logging(rank)
    return Runtime(rank, local_rank, world_size, dev, compute_dtype(dtype, use_cuda, training=training))


DTYPE_NAMES = ("float32", "bfloat16")  # the dtypes settings and exports name (besides "auto")


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype of a settings name in :data:`DTYPE_NAMES`; None for any other name ("auto")."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name)


def compute_dtype(dtype: str, use_cuda: bool, *, training: bool) -> torch.dtype:
    """The dtype a stage computes in: ``dtype`` itself, or for ``auto`` the rule of :func:`init`:
    bfloat16 on a GPU, and for training on a CPU that multiplies bfloat16 natively; float32 elsewhere."""
    import torch

    chosen = dtype_named(dtype)
    if chosen is not None:
        return chosen
    return torch.bfloat16 if use_cuda or (training and cpu_multiplies_bf16()) else torch.float32


MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
# mallopt() parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory_in_heap(limit_bytes: int = 2**31 - 1) -> bool:
    """Make glibc's malloc keep freed blocks of up to ``limit_bytes`` for reuse (CPU training).

    A CPU training step frees and reallocates the same activation and gradient buffers (MBs
    each) every step. glibc's default hands large blocks back to the kernel (``munmap``, heap
    trimming), so the next step faults every page back in, zero-filled. On 2 CPU cores (d4,
    batch 16 x 256, bench/cpu_allocator.py) keeping them makes a step 1.04x faster at vocab
    1024, 1.33x at 4096 and 1.42x at 32768, where the logits and their gradients are largest.
    Serving blocks below ``limit_bytes`` (at most what ``mallopt`` takes, 2 GiB) from the heap
    and not trimming it keeps the step's peak memory resident, which the next step needs anyway.
    Returns whether the settings were applied: not on non-glibc systems, and not when the user
    set glibc's malloc environment variables (theirs win).
    """
    if not sys.platform.startswith("linux") or any(name in os.environ for name in MALLOC_ENV):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    settings = ((_M_MMAP_THRESHOLD, limit_bytes), (_M_TRIM_THRESHOLD, limit_bytes), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(param, value) == 1 for param, value in settings)  # stops at the first refusal


def freeze_startup_heap() -> int:
    """Exempt the objects alive now from the cyclic garbage collector (``gc.freeze``): for a
    long-lived process (the server, its batch process) once it is set up. Returns how many.

    Startup leaves hundreds of thousands of objects (torch's, the model's, the web framework's) that
    live as long as the process. Python's full (generation 2) collection walks every one of them, and
    the process stops while it does: on a 2-core Xeon, 113 ms in the server and 97 ms in its batch
    process during bench/serve_latency.py's load, each such pause a first-token time in the load's
    p99. Frozen, they are never walked again; objects made later are collected as before. A
    collection first, so that startup's garbage is freed rather than kept.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_stage(
    settings_cls, body, argv: list[str] | None = None, *, distributed: bool = True, training: bool = False
) -> None:
    """Every stage's entry point: SIGTERM handling, settings, logging, ``body``, teardown.

    Settings come from params.yaml + profile + env + ``argv`` (default ``sys.argv[1:]``), and every
    params section is validated first, so a bad value stops the stage before any work. A SIGTERM
    from then on unwinds the stage (:class:`Terminated`), so its MLflow run ends KILLED.

    ``distributed`` stages (training, eval) get the process group torchrun describes and a device:
    ``body(cfg, rt)``. The others (data, tokenizer, report, export) run in one process and need
    neither: ``body(cfg)``. ``training`` stages may run in bf16 on CPU (see :func:`init`).
    """
    from chatpipe.settings import load_section, validate_all

    stop_with_launcher()
    cfg = load_section(settings_cls, sys.argv[1:] if argv is None else argv)
    validate_all()
    if distributed:
        rt = init(cfg.device, cfg.dtype, training=training)
        try:
            stage_threads()
            body(cfg, rt)
        finally:
            shutdown()
    else:
        setup_logging()
        stage_threads()
        body(cfg)
    if argv is None:
        exit_now()


def exit_now() -> None:
    """End a stage run as a program once its work is done and saved: flush the logs, then leave
    without the interpreter's teardown. Freeing torch's and MLflow's modules object by object takes
    ~0.7 s on 2 cores, once per stage of every pipeline run; every file, checkpoint and MLflow run
    is closed by then (``tracked_run`` flushed and ended it). Stages called in-process with an
    explicit ``argv`` (tests) return normally."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Terminated(SystemExit):
    """Raised in a stage on SIGTERM (the launcher cancelling it): unwinds ``finally`` blocks and
    ends the MLflow run as KILLED instead of leaving it RUNNING."""


def _terminated(signum, frame) -> None:
    raise Terminated(128 + signum)


def stop_with_launcher() -> None:
    """SIGTERM unwinds the stage; under the launcher, the death of our parent kills us.

    The launcher's guard already set PR_SET_PDEATHSIG before exec for processes it starts itself;
    workers torchrun starts (``CHATPIPE_PDEATHSIG`` inherited) set it here against torchrun, so
    a killed torchrun takes its workers along. A parent that died before this call shows up as
    PID 1 (or a subreaper), and the stage stops at once.
    """
    signal.signal(signal.SIGTERM, _terminated)
    if os.environ.get("CHATPIPE_PDEATHSIG") != "1" or not sys.platform.startswith("linux"):
        return
    from chatpipe.procs import die_with_parent, parent_gone

    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if parent_gone(parent):
        raise SystemExit("parent process gone before the stage started")


def shutdown() -> None:
    """Tear down the process group (call from ``finally``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op in a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
