"""Pretraining data at speedrun scale (issue 32): memory per rank, tokenization speed, batch wait, resume.

    python bench/data_scale.py --gb 0.5 [--out bench/out/data_scale] [--tokenize-all]

1. Writes a synthetic corpus of ``--gb`` GB of text in the hub's parquet layout
   (``shard_00000.parquet`` ..., one ``text`` column, ``--shard-mb`` MB each) from tiny-world
   documents joined to web-like lengths (800-11,000 chars, ~200-3,000 tokens). The corpus is
   repeated local text: ``--distinct`` distinct shards (differently ordered), the rest copies.
2. Tokenization: chatpipe's ``tokenize_shards`` on one shard against tiktoken's raw
   ``encode_ordinary_batch`` on the same texts with the same thread count.
3. Builds the token store of the whole corpus. Without ``--tokenize-all`` each distinct shard is
   tokenized once and its token files are written again for its copies (the same bytes a
   tokenizer would produce for the same text), so a 2 GB store is built in seconds on 2 cores.
4. For ranks 0 and 7 of a simulated world of 8 (each a fresh process, as on a node), at the
   speedrun's per-rank shape 16 x 2048: resident memory while loading (RSS and private RssAnon),
   how long the training thread waits in ``next_batch`` per step with a simulated step running
   (GIL held part of it, like Python launching kernels), and resume time at step 10 and 50,000.

Prints ratios at the end; ``--json`` writes every number to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.data.loader import RowLoader, TokenDocs, tokenize_shards  # noqa: E402
from chatpipe.data.synthetic import pretrain_documents  # noqa: E402
from chatpipe.data.tokenstore import save_shard, token_dtype, write_index  # noqa: E402
from chatpipe.tokenizer import Tokenizer  # noqa: E402

BATCH, SEQ, WORLD = 16, 2048, 8  # the speedrun's per-rank shape and world size


def web_like_docs(n_chars: int, seed: int) -> list[str]:
    """Tiny-world paragraphs joined into documents of 800-11,000 chars until ``n_chars`` in all."""
    rng = random.Random(seed)
    pool = pretrain_documents(seed=seed, num_docs=4000)
    docs, total = [], 0
    while total < n_chars:
        want, parts, size = rng.randint(800, 11000), [], 0
        while size < want:
            parts.append(rng.choice(pool))
            size += len(parts[-1]) + 1
        docs.append(" ".join(parts))
        total += size
    return docs


def write_corpus(out: Path, gb: float, shard_mb: int, distinct: int) -> list[Path]:
    """The hub layout: ``shard_{i:05d}.parquet`` files of ``shard_mb`` MB of text each."""
    n_shards = max(1, round(gb * 1000 / shard_mb))
    out.mkdir(parents=True, exist_ok=True)
    bases = []
    for d in range(min(distinct, n_shards)):
        path = out / f"shard_{d:05d}.parquet"
        if not path.exists():
            pq.write_table(pa.table({"text": web_like_docs(shard_mb * 10**6, seed=d)}), path, row_group_size=1024)
        bases.append(path)
    for i in range(len(bases), n_shards):
        path = out / f"shard_{i:05d}.parquet"
        if not path.exists():
            shutil.copyfile(bases[i % len(bases)], path)
    return sorted(out.glob("shard_*.parquet"))[:n_shards]


def _text_bytes(shard: Path) -> int:
    """UTF-8 bytes of the shard's text column (parquet compresses it on disk)."""
    import pyarrow.compute as pc

    return int(pc.sum(pc.binary_length(pq.read_table(shard, columns=["text"]).column(0))).as_py())


def as_train_split(shards: list[Path], text_dir: Path) -> Path:
    """The data stage's naming (``train_XXXXX.parquet``) as links to the hub files."""
    shutil.rmtree(text_dir, ignore_errors=True)
    text_dir.mkdir(parents=True)
    for i, shard in enumerate(shards):
        (text_dir / f"train_{i:05d}.parquet").symlink_to(shard.resolve())
    return text_dir


def tokenize_speed(shard: Path, tok: Tokenizer, work: Path, repeats: int = 3) -> dict:
    """tokens/s of chatpipe's tokenize_shards vs raw ``encode_ordinary_batch`` on the same text."""
    texts = pq.read_table(shard, columns=["text"]).column(0).to_pylist()
    threads = 4  # chatpipe.tokenizer.Tokenizer.encode's default
    text_dir = as_train_split([shard], work / "speed_text")
    raw_s = ours_s = float("inf")
    for _ in range(repeats):  # alternated, best of each: the shared machine's load comes and goes
        t0 = time.perf_counter()
        ids = tok.enc.encode_ordinary_batch(texts, num_threads=threads)
        raw_s = min(raw_s, time.perf_counter() - t0)
        n_tokens = sum(map(len, ids)) + len(ids)  # + one BOS per document, as the store holds
        del ids
        t0 = time.perf_counter()  # ours from the parquet file: reading it is part of the job
        tokenize_shards(text_dir, tok, work / "speed_tokens", fingerprint=str(time.time()))
        ours_s = min(ours_s, time.perf_counter() - t0)
        shutil.rmtree(work / "speed_tokens")
    return {
        "mb": shard.stat().st_size / 1e6,
        "threads": threads,
        "cores": os.cpu_count(),
        "raw_tok_s": n_tokens / raw_s,
        "ours_tok_s": n_tokens / ours_s,
        "ratio": raw_s / ours_s,
    }


def build_store(shards: list[Path], distinct: int, tok: Tokenizer, store: Path, tokenize_all: bool) -> float:
    """Seconds to build the token store of ``shards`` (see the module docstring, step 3)."""
    t0 = time.perf_counter()
    text_dir = as_train_split(shards, store.parent / "text")
    if tokenize_all:
        tokenize_shards(text_dir, tok, store, fingerprint=f"all-{len(shards)}")
        return time.perf_counter() - t0
    shutil.rmtree(store, ignore_errors=True)
    base_store = store.parent / "base_tokens"
    tokenize_shards(as_train_split(shards[:distinct], store.parent / "base_text"), tok, base_store, fingerprint="b")
    store.mkdir(parents=True)
    for i in range(len(shards)):
        d = i % distinct
        tokens = np.load(base_store / f"train_{d:05d}.tokens.npy", mmap_mode="r")
        offsets = np.load(base_store / f"train_{d:05d}.offsets.npy")
        save_shard(store, f"train_{i:05d}", np.asarray(tokens), offsets)
    write_index(store, "train")
    return time.perf_counter() - t0


def _mem_mb() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kb = {k: int(status[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    return {k: v / 1024 for k, v in kb.items()}


def simulated_step(step_s: float, gil_frac: float) -> None:
    """A training step: ``gil_frac`` of it busy in Python (GIL held), the rest waiting (GPU work)."""
    end = time.perf_counter() + step_s * gil_frac
    while time.perf_counter() < end:
        pass
    time.sleep(step_s * (1 - gil_frac))


def rank_child(store: Path, rank: int, steps: int, step_s: float, gil_frac: float) -> dict:
    """One simulated rank (run in its own process): memory, batch wait, resume times."""
    import torch  # loaded before the baseline memory reading, as in a training process

    torch.zeros(1)
    base = _mem_mb()
    shape = dict(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=WORLD)
    docs = TokenDocs(store, "train")
    loader = RowLoader(docs, prefetch=True, **shape)
    loader.next_batch()  # the first batch is built on demand: nothing to overlap with yet
    waits: dict[float, list[float]] = {0.0: [], gil_frac: []}
    for frac, w in waits.items():  # a step all on the device, then one that holds the GIL part of the time
        for _ in range(steps):
            simulated_step(step_s, frac)
            t0 = time.perf_counter()
            loader.next_batch()
            w.append(time.perf_counter() - t0)
    loader.close()
    after = _mem_mb()
    # resume at step 10: the state of a run that took 10 steps; then the same cursor labelled
    # step 50,000 (a restore never looks at the row count: no packing is replayed either way)
    run = RowLoader(docs, **shape)
    t0 = time.perf_counter()
    for _ in range(10):
        run.next_batch()
    replay_row_s = (time.perf_counter() - t0) / (10 * BATCH * WORLD)  # what the old design replayed per row
    resume = {}
    for step in (10, 50_000):
        state = {**run.state(), "row": step * BATCH * WORLD}
        t0 = time.perf_counter()
        RowLoader(docs, state=state, prefetch=True, **shape).next_batch()
        resume[step] = time.perf_counter() - t0
    return {
        "rank": rank,
        "mem_base_mb": base,
        "mem_loaded_mb": after,
        "wait_ms_mean": 1e3 * float(np.mean(waits[gil_frac])),
        "wait_ms_p99": 1e3 * float(np.percentile(waits[gil_frac], 99)),
        "wait_ms_mean_device_bound": 1e3 * float(np.mean(waits[0.0])),
        "gil_frac": gil_frac,
        "build_ms": _build_ms(docs, shape),
        "resume_s_step10": resume[10],
        "resume_s_step50000": resume[50_000],
        "old_replay_s_step50000": replay_row_s * 50_000 * BATCH * WORLD,
    }


def _build_ms(docs: TokenDocs, shape: dict) -> float:
    """Time to build one step's batch on the calling thread (what the old loader put on every step)."""
    loader = RowLoader(docs, **shape)
    t0 = time.perf_counter()
    for _ in range(5):
        loader.next_batch()
    return 1e3 * (time.perf_counter() - t0) / 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--shard-mb", type=int, default=32)
    ap.add_argument("--distinct", type=int, default=2)
    ap.add_argument("--tokenize-all", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--gil-frac", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "data_scale")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    store = args.out / f"store_{args.gb}gb"
    if args.child_rank is not None:
        print(json.dumps(rank_child(store, args.child_rank, args.steps, args.step_s, args.gil_frac)))
        return
    report = run_bench(args, store)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def run_bench(args: argparse.Namespace, store: Path) -> dict:
    """Corpus, tokenizer, speed, store, then one child process per simulated rank; prints the table."""
    t0 = time.perf_counter()
    shards = write_corpus(args.out / f"corpus_{args.shard_mb}mb", args.gb, args.shard_mb, args.distinct)
    text_gb = sum(_text_bytes(s) for s in shards) / 1e9
    disk_gb = sum(s.stat().st_size for s in shards) / 1e9
    print(
        f"corpus: {len(shards)} parquet shards, {text_gb:.2f} GB of text, {disk_gb:.2f} GB on disk "
        f"({time.perf_counter() - t0:.0f}s)"
    )
    tok_path = args.out / "tokenizer"
    if not (tok_path / "tokenizer.json").exists():
        Tokenizer.train(pretrain_documents(seed=0, num_docs=3000), vocab_size=4096).save(tok_path)
    tok = Tokenizer.load(tok_path)
    speed = tokenize_speed(shards[0], tok, args.out)
    print(
        f"tokenize {speed['mb']:.0f} MB shard, {speed['threads']} threads on {speed['cores']} cores: "
        f"raw tiktoken {speed['raw_tok_s'] / 1e6:.2f} Mtok/s, chatpipe {speed['ours_tok_s'] / 1e6:.2f} Mtok/s "
        f"-> {speed['ratio']:.2f}x raw"
    )
    build_s = build_store(shards, args.distinct, tok, store, args.tokenize_all)
    n_tokens = sum(np.load(p, mmap_mode="r").shape[0] for p in store.glob("train_*.tokens.npy"))
    token_mb = n_tokens * token_dtype(tok.vocab_size).itemsize / 1e6
    print(
        f"store: {n_tokens / 1e6:.0f}M tokens, {token_mb:.0f} MB (what the old loader loaded per rank), {build_s:.0f}s"
    )
    ranks = []
    for rank in (0, WORLD - 1):
        cmd = [sys.executable, __file__, "--gb", str(args.gb), "--out", str(args.out), "--child-rank", str(rank)]
        cmd += ["--steps", str(args.steps), "--step-s", str(args.step_s), "--gil-frac", str(args.gil_frac)]
        ranks.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    for r in ranks:
        m, b = r["mem_loaded_mb"], r["mem_base_mb"]
        print(
            f"rank {r['rank']}/{WORLD}: RSS {m['VmRSS']:.0f} MB (anon {m['RssAnon']:.0f}, file {m['RssFile']:.0f}; "
            f"+{m['VmRSS'] - b['VmRSS']:.0f} MB over torch+imports), peak {m['VmHWM']:.0f} MB | "
            f"wait {r['wait_ms_mean']:.3f} ms/step (p99 {r['wait_ms_p99']:.3f}; GIL held {r['gil_frac']:.0%} of "
            f"the step), {r['wait_ms_mean_device_bound']:.3f} ms (step on the device) vs {r['build_ms']:.1f} ms to build "
            f"| resume step 10 {r['resume_s_step10']:.3f}s, step 50,000 {r['resume_s_step50000']:.3f}s "
            f"(old replay ~{r['old_replay_s_step50000']:.0f}s)"
        )
    r0 = ranks[0]
    print(
        f"ratios: tokenize ours/raw {speed['ratio']:.2f} | wait/build {r0['wait_ms_mean'] / r0['build_ms']:.3f} | "
        f"resume 50000/10 {r0['resume_s_step50000'] / r0['resume_s_step10']:.2f} | "
        f"old replay/new resume at 50000 {r0['old_replay_s_step50000'] / r0['resume_s_step50000']:.0f}x | "
        f"RSS/old-loader-tokens {r0['mem_loaded_mb']['VmRSS'] / token_mb:.3f}"
    )
    return {"gb": text_gb, "tokens": n_tokens, "tokenize": speed, "store_build_s": build_s, "ranks": ranks}


if __name__ == "__main__":
    main()
