"""Pretraining tokens/s: chatpipe eager and compiled against nanochat's ``base_train`` on this machine.

    python bench/pretrain_vs_nanochat.py [--steps 12] [--rounds 2] [--threads N] [--nanochat DIR [--nanochat-python PY]]

The config is the issue's: depth 4 (n_embd 256, head_dim 64), sequence 256, batch 16 x 256 = 4096
tokens per step, vocab 1024, fp32, CPU. Every measurement runs in its own process, and a step is
what the pretrain stage times: the loader's next batch, forward/backward, the optimizer, the loss
read back (:func:`chatpipe.train.step.train_step`); nanochat's logged step covers the same.

1. ``nanochat`` recipe (our model with every nanochat option: value embeddings, lambdas, smear,
   backout, SSSL quarter windows, q/k scale, vocab padding; MuonAdamW in nanochat's order of
   operations), compiled and eager;
2. with ``--nanochat DIR`` (a checkout of karpathy/nanochat), its ``scripts.base_train`` at the same
   config (its defaults, ``--depth 4 --head-dim 64``), tokens/s parsed from its log;
3. ``nanochat_gram``: recipe 1 with ``polar_express="gram"`` (the same polynomial in Gram space,
   as profile ``tiny_nanochat`` runs it), compiled;
4. the ``tiny`` profile's own recipe (params.yaml: full attention, MuonAdamW): compiled in every
   round, eager once at the end;
5. the headline: the tiny pretrain as the pipeline runs it (eager or compiled, whatever
   ``compile: auto`` picks for its 100 steps on this CPU) in every round, against nanochat.
   ``--pipeline-only`` runs just this pair; ``--cpu-time`` compares process CPU seconds per step
   at 1 thread instead of wall time (both flags: the headline pair in CPU time, the measure that
   holds on a machine other jobs load).

Rounds of (ours compiled, nanochat, the pipeline's tiny run, ours gram compiled, tiny compiled,
ours eager) interleave so load from other processes hits all alike; each ratio is the median of
the per-round ratios.
Without a checkout it says so and why.

Steady rates are medians over the steps after the first. The first compiled step includes
compiling the model and the optimizer; the break-even step count (when compiling pays for itself)
is ``compile_s / (eager_step_s - compiled_step_s)``. The first compiled run uses an empty
inductor cache (a fresh machine); later ones reuse it, as a re-run of the stage would.

nanochat needs its own environment and data (it downloads both from the hub otherwise). Once:

    python3 -m venv /work/nanochat-venv
    /work/nanochat-venv/bin/pip install torch==2.13.0 filelock numpy psutil pyarrow rustbpe tiktoken \\
        jinja2 requests wandb pyyaml
    python bench/pretrain_vs_nanochat.py --nanochat DIR --nanochat-python /work/nanochat-venv/bin/python

The script writes synthetic text shards (chatpipe's tiny world) as nanochat's parquet dataset and
trains its tokenizer (vocab 1024) with its own ``scripts.tok_train``, under ``--nanochat-base``
(its NANOCHAT_BASE_DIR), and reuses them on later runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.data.loader import RowLoader, TokenDocs  # noqa: E402
from chatpipe.data.tokenstore import save_shard, write_index  # noqa: E402
from chatpipe.model.gpt import GPT, config_from_depth, nanochat_options  # noqa: E402
from chatpipe.runtime import Runtime, init  # noqa: E402
from chatpipe.settings import PretrainSettings, resolve_params  # noqa: E402
from chatpipe.train.optim import build_optimizers  # noqa: E402
from chatpipe.train.pretrain_plan import compile_pays, model_config_for, polar_express_dtype  # noqa: E402
from chatpipe.train.step import train_step  # noqa: E402

DEPTH, HEAD_DIM, SEQ, BATCH, VOCAB = 4, 64, 256, 16, 1024
TOKENS = BATCH * SEQ
TINY_PRETRAIN = resolve_params(profile="tiny")["pretrain"]  # params.yaml's pretrain section (profile tiny)
PIPELINE_STEPS = TINY_PRETRAIN["max_steps"]  # the tiny pretrain's horizon
DEFAULT_BASE = Path(tempfile.gettempdir()) / "chatpipe_bench_nanochat"


def make(recipe: str, compile_optimizer: bool, rt: Runtime | None = None) -> tuple[GPT, list[torch.optim.Optimizer]]:
    """The model and optimizers of ``recipe`` at the benchmark config (seeded); ``rt``: the tiny
    recipe's runtime (its dtype decides Polar Express's, as in the stage), float32 CPU by default."""
    torch.manual_seed(0)
    if recipe in ("nanochat", "nanochat_gram"):
        config = config_from_depth(DEPTH, VOCAB, SEQ, head_dim=HEAD_DIM, window_pattern="SSSL", **nanochat_options(SEQ))
        model = GPT(config)
        model.init_weights()
        opts = build_optimizers(
            model,
            optimizer="normuon_polar_express",
            embedding_lr=0.3,
            unembedding_lr=0.008,
            weight_decay=0.28,
            compile=compile_optimizer,
            polar_express="gram" if recipe == "nanochat_gram" else "direct",
        )
        return model, opts
    cfg = PretrainSettings(**{**TINY_PRETRAIN, "depth": DEPTH, "head_dim": HEAD_DIM, "sequence_len": SEQ})
    model = GPT(model_config_for(cfg, VOCAB))
    model.init_weights()
    rt = rt or Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    opts = build_optimizers(
        model, **cfg.optimizer_kwargs(), compile=compile_optimizer, polar_dtype=polar_express_dtype(cfg, rt)
    )
    return model, opts


def pipeline_compile_choice() -> bool:
    """What ``compile: auto`` picks for the tiny pretrain's model on this CPU (the stage's rule)."""
    return compile_pays(TINY_PRETRAIN["compile"], PIPELINE_STEPS, torch.device("cpu"))


def random_docs(directory: Path, n_docs: int = 2000, seed: int = 0) -> TokenDocs:
    """Token documents of random ids and lengths (about the tiny world's: ~250 tokens) for the loader."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(40, 460, n_docs)
    tokens = rng.integers(0, VOCAB, int(lengths.sum())).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    save_shard(directory, "train_000", tokens, offsets)
    write_index(directory, "train")
    return TokenDocs(directory, "train")


def worker(recipe: str, compiled: bool, steps: int) -> dict:
    """Run ``steps + 1`` training steps the way the stage does; seconds of each."""
    # the stage's runtime, with its CPU allocator setting; the tiny recipe in the dtype the pretrain
    # stage picks here (dtype: auto, bf16 autocast on CPUs with bf16 dot products), the
    # nanochat-recipe comparisons in float32, as nanochat runs on CPU
    rt = init("cpu", "auto" if recipe == "tiny" else "float32", training=True)
    model, opts = make(recipe, compile_optimizer=compiled, rt=rt)
    step_model = torch.compile(model, dynamic=False) if compiled else model
    with tempfile.TemporaryDirectory() as tmp:
        loader = RowLoader(random_docs(Path(tmp)), batch_size=BATCH, seq_len=SEQ)
        times, cpu = [], []
        for _ in range(steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(step_model, loader.next_batch, opts, grad_accum=1, rt=rt)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {
        "first_s": times[0],
        "step_s": times[1:],
        "cpu_s": cpu[1:],
        "threads": torch.get_num_threads(),
        "dtype": str(rt.dtype).removeprefix("torch."),
    }


def optimizer_forms(steps: int) -> None:
    """MuonAdamW's step, Polar Express direct vs gram, interleaved step by step in this one process.

    Both optimizers step copies of the nanochat-recipe model on the same gradients (one backward
    pass), eagerly, so the ratio is the optimizer's own and holds on a machine whose speed drifts
    between processes.
    """
    times: dict[str, list[float]] = {"direct": [], "gram": []}
    pairs = {}
    for form in times:
        model, [opt] = make("nanochat_gram" if form == "gram" else "nanochat", compile_optimizer=False)
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        model(idx[:, :-1], idx[:, 1:]).backward()
        pairs[form] = opt
    for i in range(steps + 1):
        for form, opt in pairs.items():
            c0 = time.process_time()
            opt.step()
            if i:  # the first step allocates the optimizer state
                times[form].append(time.process_time() - c0)
    direct, gram = (statistics.median(times[f]) for f in ("direct", "gram"))
    print(
        f"MuonAdamW step (eager, {steps} interleaved steps, CPU s): direct {direct * 1000:.0f} ms, "
        f"gram {gram * 1000:.0f} ms, direct / gram {direct / gram:.2f}"
    )


def ours(recipe: str, compiled: bool, steps: int, env: dict[str, str]) -> dict:
    """:func:`worker` in a fresh process (compiling starts from that process's inductor cache)."""
    cmd = [sys.executable, __file__, "--worker", recipe, "compiled" if compiled else "eager", str(steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    result["rate"] = TOKENS / statistics.median(result["step_s"])
    return result


def prepare_nanochat_base(checkout: Path, python: str, base: Path) -> None:
    """nanochat's dataset (parquet shards, the last one is its val split) and tokenizer under ``base``."""
    from chatpipe.data import synthetic

    data_dir = base / "base_data_climbmix"
    if not sorted(data_dir.glob("shard_*.parquet")):
        import pyarrow as pa
        import pyarrow.parquet as pq

        data_dir.mkdir(parents=True, exist_ok=True)
        docs = synthetic.pretrain_documents(seed=42, num_docs=4000)
        for i in range(2):
            part = pa.table({"text": docs[i * 2000 : (i + 1) * 2000]})
            pq.write_table(part, data_dir / f"shard_{i:05d}.parquet", row_group_size=500)
    if not (base / "tokenizer" / "token_bytes.pt").exists():
        env = {**os.environ, "NANOCHAT_BASE_DIR": str(base)}
        cmd = [python, "-m", "scripts.tok_train", f"--vocab-size={VOCAB}", "--max-chars=2000000"]
        r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"nanochat tok_train failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")


def nanochat(checkout: Path, python: str, base: Path, steps: int) -> dict:
    """nanochat's base_train at the benchmark config: median tok/sec of its logged steps after the first."""
    cmd = [
        python,
        "-m",
        "scripts.base_train",
        f"--depth={DEPTH}",
        f"--head-dim={HEAD_DIM}",
        f"--max-seq-len={SEQ}",
        f"--device-batch-size={BATCH}",
        f"--total-batch-size={TOKENS}",
        f"--num-iterations={steps + 1}",
        "--eval-every=-1",
        "--core-metric-every=-1",
        "--sample-every=-1",
    ]
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base)}
    r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"nanochat base_train failed ({' '.join(cmd)}):\n{(r.stdout + r.stderr)[-3000:]}")
    dts = [float(m) / 1000 for m in re.findall(r"\| dt: ([\d.]+)ms", r.stdout + r.stderr)]
    if len(dts) < 2:
        raise RuntimeError("no 'dt: ...ms' step lines in nanochat's output; its log format changed")
    return {"first_s": dts[0], "step_s": dts[1:], "rate": TOKENS / statistics.median(dts[1:])}


# nanochat's own GPT and optimizer, built the way its base_train builds them, timed per step in
# process CPU seconds (run with its Python, in its checkout; prints one JSON line)
NANOCHAT_CPU_PROBE = """
import json, sys, time, torch
from nanochat.gpt import GPT, GPTConfig
depth, head_dim, seq, batch, vocab, steps = map(int, sys.argv[1:7])
dim = depth * 64
config = GPTConfig(sequence_len=seq, vocab_size=vocab, n_layer=depth, n_head=dim // head_dim,
                   n_kv_head=dim // head_dim, n_embd=dim, window_pattern="SSSL")
with torch.device("meta"):
    model = GPT(config)
model.to_empty(device="cpu")
model.init_weights()
step_model = torch.compile(model, dynamic=False)
opt = model.setup_optimizer(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, weight_decay=0.28, scalar_lr=0.5)
gen = torch.Generator().manual_seed(1)
times, cpu = [], []
for _ in range(steps + 1):
    t0, c0 = time.perf_counter(), time.process_time()
    rows = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    loss = step_model(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
    loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    loss.item()
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
print(json.dumps({"first_s": times[0], "step_s": times[1:], "cpu_s": cpu[1:]}))
"""


def nanochat_cpu(checkout: Path, python: str, steps: int) -> dict:
    """nanochat's compiled model and MuonAdamW on random tokens: CPU seconds per step (see NANOCHAT_CPU_PROBE)."""
    args = [str(v) for v in (DEPTH, HEAD_DIM, SEQ, BATCH, VOCAB, steps)]
    r = subprocess.run(
        [python, "-c", NANOCHAT_CPU_PROBE, *args], cwd=checkout, capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        raise RuntimeError(f"nanochat CPU-time probe failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def nanochat_skip_reason(checkout: Path | None, python: str) -> str | None:
    """Why nanochat cannot run here, or None when it can."""
    if checkout is None:
        return "no --nanochat DIR given (a checkout of karpathy/nanochat)"
    if not (checkout / "scripts" / "base_train.py").exists():
        return f"{checkout} has no scripts/base_train.py: not a nanochat checkout"
    probe = "import torch, rustbpe, tiktoken, pyarrow, wandb, filelock, yaml"
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return (
            f"{python} lacks nanochat's dependencies ({r.stderr.strip().splitlines()[-1]}); see this file's docstring"
        )
    return None


def load_average() -> str:
    """The 1-minute load average (other processes share the cores)."""
    return f"{os.getloadavg()[0]:.1f}"


def cpu_time_comparison(args: argparse.Namespace, nc_python: str, skip: str | None) -> None:
    """Rounds of (ours compiled: nanochat recipe, direct and gram; the tiny pretrain as the pipeline runs
    it; nanochat compiled) at 1 thread, CPU s per step; with ``--pipeline-only`` just the last two.

    A loaded machine stretches wall time but hardly the CPU time a single-threaded step needs, so
    this ratio holds while other jobs run. It times nanochat's model and optimizer (not its
    base_train loop, whose log has wall time only) on random tokens, like our worker.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"d{DEPTH} head_dim {HEAD_DIM} seq {SEQ} batch {BATCH} vocab {VOCAB}, 1 thread, CPU seconds per step")
    env = dict(os.environ)
    pipeline_compiles = pipeline_compile_choice()
    runs = {"tiny as the pipeline runs it": ("tiny", pipeline_compiles)}
    if not args.pipeline_only:
        runs = {"nanochat recipe": ("nanochat", True), "nanochat recipe, gram": ("nanochat_gram", True), **runs}
    cpu: dict[str, list[float]] = {name: [] for name in (*runs, "nanochat")}
    for r in range(args.rounds):
        line = f"round {r + 1} (load {load_average()}):"
        for name, (recipe, compiled) in runs.items():
            cpu[name].append(statistics.median(ours(recipe, compiled, args.steps, env)["cpu_s"]))
            line += f" {name} {TOKENS / cpu[name][-1]:,.0f} tok/CPU-s,"
        if skip is None:
            cpu["nanochat"].append(statistics.median(nanochat_cpu(args.nanochat, nc_python, args.steps)["cpu_s"]))
            line += f" nanochat compiled {TOKENS / cpu['nanochat'][-1]:,.0f}, ratios "
            line += " / ".join(f"{cpu['nanochat'][-1] / cpu[name][-1]:.3f}" for name in runs)
        print(line.rstrip(","), flush=True)
    if skip is not None:
        print(f"nanochat: skipped ({skip})")
        return
    mode = "compiled" if pipeline_compiles else "eager"
    for name in runs:
        ratio = statistics.median(t / m for t, m in zip(cpu["nanochat"], cpu[name]))
        shown = f"{name}, {mode}" if name.startswith("tiny") else name
        print(f"ours ({shown}) / nanochat (CPU time): {ratio:.3f} (median of {args.rounds} per-round ratios)")


def pipeline_comparison(args: argparse.Namespace, nc_python: str, skip: str | None) -> None:
    """Rounds of (nanochat base_train, the tiny pretrain as the pipeline runs it), wall time."""
    if skip is not None:
        print(f"nanochat: skipped ({skip})")
        return
    compiles = pipeline_compile_choice()
    mode = "compiled" if compiles else "eager"
    print(f"d{DEPTH} seq {SEQ} batch {BATCH} vocab {VOCAB}, {torch.get_num_threads()} threads; tiny runs {mode}")
    ratios = []
    for r in range(args.rounds):
        theirs = nanochat(args.nanochat, nc_python, args.nanochat_base, args.steps)
        mine = ours("tiny", compiles, args.steps, dict(os.environ))
        ratios.append(mine["rate"] / theirs["rate"])
        print(
            f"round {r + 1} (load {load_average()}): nanochat {theirs['rate']:,.0f} tok/s, "
            f"tiny ({mode}, {mine['dtype']}) {mine['rate']:,.0f}, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"tiny as the pipeline runs it ({mode}, compile: auto at {PIPELINE_STEPS} steps) / nanochat: "
        f"{statistics.median(ratios):.3f} (median of {len(ratios)} per-round ratios)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per run, after the first")
    p.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds of (ours compiled, nanochat, gram, tiny, ours eager)"
    )
    p.add_argument("--nanochat", type=Path, help="a karpathy/nanochat checkout to run base_train from")
    p.add_argument("--nanochat-python", help="Python with nanochat's dependencies (default: DIR/.venv/bin/python)")
    p.add_argument("--nanochat-base", type=Path, default=DEFAULT_BASE, help="NANOCHAT_BASE_DIR for its data")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="compare process CPU seconds per step at 1 thread instead (steady under load from other processes)",
    )
    p.add_argument(
        "--pipeline-only",
        action="store_true",
        help="only rounds of (nanochat, the tiny pretrain as the pipeline runs it): the headline ratio, quickly "
        "(with --cpu-time: in CPU seconds at 1 thread)",
    )
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every run, ours and nanochat's (default: torch's)")
    p.add_argument("--worker", nargs=3, metavar=("RECIPE", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        recipe, mode, steps = args.worker
        print(json.dumps(worker(recipe, mode == "compiled", int(steps))))
        return

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every run below
        torch.set_num_threads(args.threads)
    nc_python = args.nanochat_python or (str(args.nanochat / ".venv" / "bin" / "python") if args.nanochat else "")
    skip = nanochat_skip_reason(args.nanochat, nc_python)
    if skip is None:
        prepare_nanochat_base(args.nanochat, nc_python, args.nanochat_base)
    if args.cpu_time:
        cpu_time_comparison(args, nc_python, skip)
        return
    if args.pipeline_only:
        pipeline_comparison(args, nc_python, skip)
        return
    wall_time_comparison(args, nc_python, skip)


def wall_time_comparison(args: argparse.Namespace, nc_python: str, skip: str | None) -> None:
    """Interleaved rounds of every variant (module docstring), wall time, then the summary."""
    print(
        f"d{DEPTH} head_dim {HEAD_DIM} seq {SEQ} batch {BATCH} vocab {VOCAB} fp32, {args.steps} timed steps per run, "
        f"{torch.get_num_threads()} threads, load average {load_average()}"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # empty at first: the first compile is cold
        rows: list[dict] = []
        pipeline_compiles = pipeline_compile_choice()
        for r in range(args.rounds):
            row = {"load": load_average(), "compiled": ours("nanochat", True, args.steps, env)}
            if skip is None:
                row["nanochat"] = nanochat(args.nanochat, nc_python, args.nanochat_base, args.steps)
            row["pipeline"] = ours("tiny", pipeline_compiles, args.steps, env)
            row["gram"] = ours("nanochat_gram", True, args.steps, env)
            row["tiny"] = ours("tiny", True, args.steps, env)
            row["eager"] = ours("nanochat", False, args.steps, env)
            rows.append(row)
            line = f"round {r + 1} (load {row['load']}): ours compiled {row['compiled']['rate']:,.0f} tok/s"
            line += f" (first step {row['compiled']['first_s']:.1f} s)"
            if "nanochat" in row:
                nc = row["nanochat"]
                line += f", nanochat {nc['rate']:,.0f} (first step {nc['first_s']:.1f} s)"
                line += f", ratio {row['compiled']['rate'] / nc['rate']:.2f}"
            for name, key in (("ours gram compiled", "gram"), ("tiny recipe compiled", "tiny")):
                line += f"; {name} {row[key]['rate']:,.0f}"
                if "nanochat" in row:
                    line += f", ratio {row[key]['rate'] / row['nanochat']['rate']:.2f}"
            line += f"; ours eager {row['eager']['rate']:,.0f}"
            line += f"; tiny as the pipeline runs it {row['pipeline']['rate']:,.0f}"
            if "nanochat" in row:
                line += f", ratio {row['pipeline']['rate'] / row['nanochat']['rate']:.2f}"
            print(line, flush=True)
        tiny_eager = ours("tiny", False, args.steps, env)
    optimizer_forms(args.steps)

    med = statistics.median
    comp, eager = med(r["compiled"]["rate"] for r in rows), med(r["eager"]["rate"] for r in rows)
    print(f"nanochat recipe, ours eager:    {eager:,.0f} tok/s (median of {len(rows)} runs)")
    print(f"nanochat recipe, ours compiled: {comp:,.0f} tok/s steady")
    for name, res_e, res_c in [("nanochat", rows[0]["eager"], rows[0]["compiled"])] + (
        [("nanochat (warm cache)", rows[-1]["eager"], rows[-1]["compiled"])] if len(rows) > 1 else []
    ):
        e_s, c_s = med(res_e["step_s"]), med(res_c["step_s"])
        compile_s = res_c["first_s"] - c_s
        if c_s < e_s:
            print(f"  {name}: compiling costs {compile_s:.1f} s, pays after ~{compile_s / (e_s - c_s):.0f} steps")
        else:
            print(f"  {name}: compiling costs {compile_s:.1f} s and does not pay at this config")
    print(f"nanochat recipe, ours compiled, polar_express gram: {med(r['gram']['rate'] for r in rows):,.0f} tok/s")
    tiny_compiled = rows[-1]["tiny"]  # warm cache, as a re-run of the stage
    e_s, c_s = med(tiny_eager["step_s"]), med(tiny_compiled["step_s"])
    print(f"tiny recipe, ours eager:        {TOKENS / e_s:,.0f} tok/s (one run, after the rounds)")
    print(f"tiny recipe, ours compiled:     {med(r['tiny']['rate'] for r in rows):,.0f} tok/s steady", end="")
    if c_s < e_s:
        compile_s = tiny_compiled["first_s"] - c_s
        print(f"; compiling costs {compile_s:.1f} s (warm cache), pays after ~{compile_s / (e_s - c_s):.0f} steps")
    else:
        print("; compiling does not pay at this config")
    if skip is not None:
        print(f"nanochat: skipped ({skip})")
        return
    nc_rate = med(r["nanochat"]["rate"] for r in rows)
    print(f"nanochat base_train:            {nc_rate:,.0f} tok/s steady (median of {len(rows)} runs)")
    for recipe, key in (("nanochat recipe", "compiled"), ("nanochat recipe, gram", "gram"), ("tiny recipe", "tiny")):
        ratio = med(r[key]["rate"] / r["nanochat"]["rate"] for r in rows)
        print(f"ours compiled ({recipe}) / nanochat: {ratio:.2f} (median of per-round ratios)")
    mode = "compiled" if pipeline_compiles else "eager"
    ratios = [r["pipeline"]["rate"] / r["nanochat"]["rate"] for r in rows]
    print(
        f"tiny as the pipeline runs it ({mode}, compile: auto at {PIPELINE_STEPS} steps) / nanochat: "
        f"{med(ratios):.2f} (median of per-round ratios {', '.join(f'{x:.2f}' for x in ratios)})"
    )


if __name__ == "__main__":
    main()
