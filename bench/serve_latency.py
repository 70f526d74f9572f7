"""Benchmark: the chat server against a git revision's server, on the same model, in one run.

Starts ``python -m chatpipe.serve.app`` twice on free 127.0.0.1 ports, in processes of their own:
this checkout's server and ``--baseline``'s (its tree unpacked with ``git archive``), both with a
batch of ``--batch-rows`` rows. Each gets one warm-up request; then the two take turns, load by
load, ``--repeats`` times (these VMs change speed from one minute to the next):

- **single turn**: every client streams ``--rounds`` replies of ``--max-tokens`` tokens to one-message
  chats (different prompts and seeds): the time to first token (p50, p99) and tokens/s summed over clients;
- **multi-turn**: every client holds ``--rounds`` ``--turns``-turn chats, one after the other, each
  turn's prompt its whole history (its earlier messages and the server's replies); the last turns'
  first-token p50 and p99, and tokens/s. (One chat per client would give a p99 of 16 samples: their
  maximum.) After the per-repeat ratios, the p99s of every repeat's samples pooled.

Then, against this checkout's server only: ``n: 4`` against ``n: 1`` (``/v1/chat/completions``, the
same requests, median seconds of ``--repeats`` x 4 each). The served tokens/s of this checkout's
single-turn load are set against the engine's own offline decode of the same rows and lengths, run
in this process right after that load in each repeat (after one untimed warm-up round), at the
intra-op threads the server gives its batch process: a ratio per repeat, and their median.

The clients are asyncio tasks of one thread sharing a connection pool.

Run::

    python bench/serve_latency.py --baseline f18dbe9 --model artifacts/rl [--clients 16] [--turns 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from revision import REPO, unpack

from chatpipe.runtime import freeze_startup_heap

PROMPTS = [
    "Who lives in Stonebridge?",
    "What does a cow say?",
    "Tell me a story.",
    "What is 12 + 30?",
    "Where does the river Amber flow?",
    "What is Clara's favourite food?",
    "Spell the word honey.",
    "Who is Pip?",
]
FOLLOW_UPS = ["And then?", "Why?", "Tell me more.", "What next?", "Who else?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, tree: Path | None) -> tuple[subprocess.Popen, str]:
    """A server of this checkout (``tree`` None) or of the unpacked revision ``tree``, once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "chatpipe.serve.app", "--model", args.model, "--port", str(port)]
    cmd += ["--batch-rows", str(args.batch_rows), "--max-queue", "64", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(tree or REPO)}
    proc = subprocess.Popen(
        cmd, cwd=tree or REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("server did not come up in 180 s")


async def stream_reply(client: httpx.AsyncClient, url: str, messages: list[dict], seed: int, max_tokens: int):
    """(seconds to the first streamed delta, tokens generated, the reply's text) of one ``/api/chat`` reply."""
    body = {"messages": messages, "max_tokens": max_tokens, "seed": seed, "temperature": 0.8, "top_k": 50}
    t0, ttft, tokens, text = time.perf_counter(), None, 0, []
    async with client.stream("POST", f"{url}/api/chat", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if "kind" in event:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(event.get("text", "") if event["kind"] == "text" else "")
            if event.get("done"):
                tokens = event["tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens, "".join(text)


async def run_load(url: str, args: argparse.Namespace, turns: int, repeat: int = 0) -> dict:
    """Every client runs ``--rounds`` ``turns``-turn chats, one after the other; returns
    the first-token times of every reply and of the last turns, tokens/s in total and failures.
    Each ``repeat`` draws other seeds, so no repeat finds an earlier one's replies in a prefix cache."""
    ttfts, last, total, failed = [], [], 0, 0
    seed = 100_000 * repeat

    async def client(c: int, pool: httpx.AsyncClient) -> None:
        nonlocal total, failed
        for r in range(args.rounds):
            messages: list[dict] = []
            for t in range(turns):
                question = PROMPTS[(c + r) % len(PROMPTS)] if t == 0 else FOLLOW_UPS[(c + t) % len(FOLLOW_UPS)]
                messages.append({"role": "user", "content": question})
                try:
                    ttft, tokens, text = await stream_reply(
                        pool, url, messages, seed + c * 100 + r * 10 + t, args.max_tokens
                    )
                except (httpx.HTTPError, RuntimeError):
                    failed += 1
                    break
                messages.append({"role": "assistant", "content": text})
                ttfts.append(ttft)
                if t == turns - 1:
                    last.append(ttft)
                total += tokens

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as pool:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, pool) for c in range(args.clients)))
        seconds = time.perf_counter() - t0
    return {"ttfts": ttfts, "last": last, "tps": total / seconds, "failed": failed}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def report(name: str, load: str, r: dict) -> None:
    times = r["last"] if load == "multi-turn" else r["ttfts"]
    p50, p99 = (percentile(times, q) * 1000 for q in (50, 99))
    what = "last turn's first token" if load == "multi-turn" else "first token"
    print(
        f"  {name}, {load}: {len(r['ttfts'])} replies, {r['failed']} failed; {what} p50 {p50:.0f} ms, "
        f"p99 {p99:.0f} ms; {r['tps']:.1f} tokens/s in total",
        flush=True,
    )


async def n_choices(url: str, n: int, max_tokens: int, seed: int) -> float:
    """Seconds of one ``/v1/chat/completions`` request for ``n`` choices, each exactly ``max_tokens``
    long (``min_tokens``): otherwise ``n: 4`` waits for the longest of four draws and ``n: 1`` for one."""
    body = {"messages": [{"role": "user", "content": PROMPTS[seed % len(PROMPTS)]}], "n": n}
    body |= {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 1.0, "seed": seed}
    async with httpx.AsyncClient(timeout=600) as client:
        body["model"] = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"n={n}: {r.status_code} {r.text[:300]}")
        return time.perf_counter() - t0


class OfflineDecode:
    """The engine's own decode, in this process: ``--clients`` rows, the single-turn prompts, at the
    intra-op threads the server gives its batch process (``chatpipe serve``'s ``share_cores(2)``: on
    2 cores, 1; the other core is the event loop's and the clients'). Built once, before the
    servers start; :meth:`tokens_per_s` runs between the served loads, while the servers idle, so
    each repeat's ratio compares the two at the same minute of these VMs' changing speed."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from chatpipe.inference.engine import Engine
        from chatpipe.model.files import load_model
        from chatpipe.runtime import share_cores
        from chatpipe.tokenizer import Tokenizer

        self.args, self.threads = args, share_cores(2)
        model, _ = load_model(args.model, torch.device("cpu"))
        tok = Tokenizer.load(str(Path(args.model).parent / "tokenizer"))
        self.prompts = [tok.render_for_completion({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]})
                        for p in PROMPTS]  # fmt: skip
        self.sched = Engine(model.eval(), tok).scheduler(args.batch_rows, model.config.sequence_len)
        self.rounds(range(-1, 0))  # a warm-up round, untimed, as the servers' warm-up request is

    def rounds(self, rounds: range) -> int:
        """Tokens of ``rounds`` rounds, each ``--clients`` requests run to the end together."""
        from chatpipe.inference.scheduler import GenRequest

        args, total = self.args, 0
        for r in rounds:
            reqs = [self.sched.submit(GenRequest(self.prompts[(c + r) % len(self.prompts)], max_tokens=args.max_tokens,
                                                 temperature=0.8, top_k=50, seed=c * 100 + max(r, 0)))
                    for c in range(args.clients)]  # fmt: skip
            self.sched.run()
            total += sum(len(q.seqs[0]) for q in reqs)
        return total

    def tokens_per_s(self) -> float:
        t0 = time.perf_counter()
        return self.rounds(range(self.args.rounds)) / (time.perf_counter() - t0)


def measure(args: argparse.Namespace) -> dict:
    """Both servers, the loads in turns, with the offline decode after each single-turn load; then
    ``n`` against this checkout's."""
    tree = unpack(args.baseline)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    results: dict = {}
    offline = OfflineDecode(args)
    # the clients run in this process, beside torch and the offline model: unfrozen, a full collection
    # here would pause every client for ~0.1 s, a first-token time for whichever server was measured
    freeze_startup_heap()
    try:
        for name, where in ((f"baseline {args.baseline}", tree), ("this checkout", None)):
            servers[name] = start_server(args, where)
            asyncio.run(
                stream_reply(httpx.AsyncClient(timeout=60), servers[name][1], [{"role": "user", "content": "hi"}], 0, 8)
            )
        for repeat in range(args.repeats):
            for load, turns in (("single turn", 1), ("multi-turn", args.turns)):
                for name, (_, url) in servers.items():
                    r = asyncio.run(run_load(url, args, turns, repeat))
                    report(name, load, r)
                    results.setdefault((name, load), []).append(r)
                if load == "single turn":  # next to this checkout's single-turn load, the ratio's other half
                    results.setdefault("offline", []).append(offline.tokens_per_s())
        url = servers["this checkout"][1]
        for n in (1, 4):
            times = [asyncio.run(n_choices(url, n, args.max_tokens, s)) for s in range(4 * args.repeats)]
            results[("n", n)] = statistics.median(times)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    results["threads"] = offline.threads
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="git revision whose server to compare with (e.g. f18dbe9)")
    p.add_argument("--model", default="artifacts/rl", help="a model directory (its tokenizer beside it)")
    p.add_argument("--batch-rows", type=int, default=16, help="rows of the continuous batch, both servers")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--rounds", type=int, default=2, help="chats per client, one after the other, in each load")
    p.add_argument("--turns", type=int, default=10, help="multi-turn: turns of each client's chat")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="times each server runs each load, taking turns")
    args = p.parse_args()
    if min(args.clients, args.batch_rows, args.repeats, args.turns, args.rounds) < 1:
        p.error("--clients, --batch-rows, --repeats, --turns and --rounds must each be >= 1")
    args.model = str(Path(args.model).resolve())
    print(f"model {args.model}, {args.clients} clients, {args.max_tokens} tokens per reply, {args.turns} turns")
    results = measure(args)
    base, this = f"baseline {args.baseline}", "this checkout"
    for load in ("single turn", "multi-turn"):
        for a, b in zip(results[(base, load)], results[(this, load)]):
            key = "last" if load == "multi-turn" else "ttfts"
            p99 = percentile(b[key], 99) / percentile(a[key], 99)
            print(f"{load}, this / baseline: tokens/s x{b['tps'] / a['tps']:.2f}, first-token p99 x{p99:.2f}")
        pooled = [[t for r in results[(name, load)] for t in r[key]] for name in (base, this)]
        ratio = percentile(pooled[1], 99) / percentile(pooled[0], 99)
        print(
            f"{load}, every repeat's first tokens pooled ({len(pooled[1])} a server): p99 "
            f"{percentile(pooled[1], 99) * 1000:.0f} ms / {percentile(pooled[0], 99) * 1000:.0f} ms = x{ratio:.2f}"
        )
    print(f"n: 4 / n: 1, median seconds: x{results[('n', 4)] / results[('n', 1)]:.2f}")
    served = [r["tps"] for r in results[(this, "single turn")]]
    ratios = [s / o for s, o in zip(served, results["offline"])]
    print(
        f"served / offline decode tokens/s ({args.clients} rows, the batch's {results['threads']} intra-op "
        f"thread(s) both), each repeat: "
        + ", ".join(f"{s:.0f} / {o:.0f} = x{s / o:.2f}" for s, o in zip(served, results["offline"]))
        + f"; median x{statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
