"""Benchmark: chat server latency and throughput, this tree's server beside another tree's.

Starts ``python -m chatpipe.serve.app`` on free 127.0.0.1 ports in subprocesses (so the clients do
not share its interpreter), twice on the same model and ``--batch-rows``: the baseline, the
``chatpipe`` package of ``--baseline DIR`` (a checkout of another commit, e.g. ``git worktree add
/tmp/f18dbe9 f18dbe9``; imported through ``PYTHONPATH``, with this venv's packages), and this tree's.
Each server gets one warm-up request, then for each concurrency level (``--clients``, default 1 and
8) every client streams ``--rounds`` replies of ``--max-tokens`` tokens (different prompts and
seeds), on the baseline and then on this tree, ``--repeats`` times in turn (these VMs change speed
from one minute to the next). Prints per server and level the time to first token (p50, p99 and
worst over every reply of the level), tokens/s summed over clients and failed replies; then per
level and turn the ratios this / baseline (tokens/s; first-token p50 and p99, lower is better), and
over several turns the median and lowest tokens/s ratio; last, per server, the time of one request
of ``--n-choices`` choices (default 4) over one of a single choice. (Before issue 71 the baseline was the
thread pool, ``--batch-rows 0``, which is gone.)

The clients are asyncio tasks of one thread sharing a connection pool: on a 2-core machine the
server shares the cores with them. ``--threaded-clients`` runs the older clients, a thread and a new
connection per reply; 16 of them woke at every decode step and used about half a core, and kept
the batch's process from its own core a fifth of the time (bench/README.md, serving round nine).

Run::

    python bench/serve_latency.py --baseline DIR [--model latest] [--batch-rows 16] [--clients 1 8] [--max-tokens 128] [--rounds 2]
    python bench/serve_latency.py --baseline /tmp/f18dbe9 --model base --clients 16 --rounds 4 --repeats 3
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
import threading
import time

import httpx

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, code: str) -> tuple[subprocess.Popen, str]:
    """A server of the ``chatpipe`` package under ``code`` (a tree's root) on a free port."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "chatpipe.serve.app",
        "--model",
        args.model,
        "--port",
        str(port),
        "--batch-rows",
        str(args.batch_rows),
        "--max-queue",
        "64",
        "--device",
        args.device,
    ]
    env = {**os.environ, "PYTHONPATH": code, "CHATPIPE_PARAMS": os.path.join(code, "params.yaml")}  # its own settings
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
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


def request_body(prompt: str, seed: int, max_tokens: int) -> dict:
    """The streamed chat request every client sends."""
    messages = [{"role": "user", "content": prompt}]
    return {"messages": messages, "max_tokens": max_tokens, "seed": seed, "temperature": 0.8, "top_k": 50}


class ReplyTimer:
    """Reads one streamed reply's event lines: the time to its first delta and its token count."""

    def __init__(self) -> None:
        self.t0, self.ttft, self.tokens = time.perf_counter(), None, 0

    def take(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        event = json.loads(line[6:])
        if self.ttft is None and "kind" in event:
            self.ttft = time.perf_counter() - self.t0
        if event.get("done"):
            self.tokens = event["tokens"]
        if "error" in event:
            raise RuntimeError(event["error"])

    def result(self) -> tuple[float, int]:
        """(seconds to the first streamed delta, tokens generated)."""
        return (self.ttft if self.ttft is not None else time.perf_counter() - self.t0), self.tokens


def one_reply(url: str, prompt: str, seed: int, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first streamed delta, tokens generated) for one streamed reply."""
    timer = ReplyTimer()
    with httpx.stream("POST", f"{url}/api/chat", json=request_body(prompt, seed, max_tokens), timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            timer.take(line)
    return timer.result()


async def one_reply_async(
    client: httpx.AsyncClient, url: str, prompt: str, seed: int, max_tokens: int
) -> tuple[float, int]:
    """:func:`one_reply` as an asyncio task, over ``client``'s connection pool."""
    timer = ReplyTimer()
    async with client.stream("POST", f"{url}/api/chat", json=request_body(prompt, seed, max_tokens)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            timer.take(line)
    return timer.result()


async def run_level_async(url: str, clients: int, rounds: int, max_tokens: int) -> tuple[list[float], float, int]:
    """:func:`run_level` with the clients as asyncio tasks of one thread (one connection pool)."""
    ttfts: list[float] = []
    total = failed = 0

    async def client(c: int, pool: httpx.AsyncClient) -> None:
        nonlocal total, failed
        for r in range(rounds):
            try:
                ttft, tokens = await one_reply_async(
                    pool, url, PROMPTS[(c + r) % len(PROMPTS)], c * 100 + r, max_tokens
                )
            except (httpx.HTTPError, RuntimeError):
                failed += 1
                continue
            ttfts.append(ttft)
            total += tokens

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as pool:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, pool) for c in range(clients)))
        return ttfts, total / (time.perf_counter() - t0), failed


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_level(url: str, clients: int, rounds: int, max_tokens: int) -> tuple[list[float], float, int]:
    """Every client streams ``rounds`` replies back to back; returns (TTFTs, summed tokens/s, failed replies)."""
    ttfts: list[float] = []
    total, failed = [0], [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(rounds):
            try:
                ttft, tokens = one_reply(url, PROMPTS[(c + r) % len(PROMPTS)], c * 100 + r, max_tokens)
            except (httpx.HTTPError, RuntimeError):
                with lock:
                    failed[0] += 1
                continue
            with lock:
                ttfts.append(ttft)
                total[0] += tokens

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, total[0] / (time.perf_counter() - t0), failed[0]


def run_and_print(name: str, url: str, clients: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """One level against one server, printed: (tokens/s, first-token p50, p99 in ms)."""
    if args.threaded_clients:
        ttfts, tps, failed = run_level(url, clients, args.rounds, args.max_tokens)
    else:
        ttfts, tps, failed = asyncio.run(run_level_async(url, clients, args.rounds, args.max_tokens))
    p50, p99 = (percentile(ttfts, q) * 1000 if ttfts else float("nan") for q in (50, 99))
    worst = max(ttfts, default=float("nan")) * 1000
    print(
        f"  {name}, {clients} client(s), {len(ttfts)} replies, {failed} failed: time to first token p50 {p50:.0f} ms, "
        f"p99 {p99:.0f} ms, worst {worst:.0f} ms; {tps:.1f} tokens/s in total",
        flush=True,
    )
    return tps, p50, p99


def choices_seconds(url: str, n: int, max_tokens: int, times: int = 5) -> float:
    """The median seconds of a whole (not streamed) /v1 chat answer of ``n`` choices, one client."""
    model = httpx.get(f"{url}/health").json()["model"]
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": max_tokens,
            "temperature": 0.8, "n": n, "seed": 1}  # fmt: skip
    seconds = []
    for _ in range(times):
        t0 = time.perf_counter()
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def measure(args: argparse.Namespace) -> dict[str, dict[int, list[tuple[float, float, float]]]]:
    """Start both servers, then run every level on each in turn, ``--repeats`` times:
    {server: {clients: [(tokens/s, p50, p99) per repeat]}}. Taking turns level by level keeps a
    machine whose speed drifts from favouring one side."""
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for name, code in (("baseline", os.path.abspath(args.baseline)), ("this", here)):
            proc, url = start_server(args, code)
            servers[name] = (proc, url)
            info = httpx.get(f"{url}/health").json()
            print(f"{name} ({code}): a batch of {args.batch_rows} rows; model {info['description']}, "
                  f"{args.max_tokens} tokens per reply", flush=True)  # fmt: skip
            one_reply(url, "warm up", 0, 8)
        results: dict[str, dict[int, list]] = {name: {c: [] for c in args.clients} for name in servers}
        for _ in range(args.repeats):
            for clients in args.clients:
                for name, (_, url) in servers.items():
                    results[name][clients].append(run_and_print(name, url, clients, args))
        if args.n_choices > 1:
            for name, (_, url) in servers.items():
                one, n = (choices_seconds(url, k, args.max_tokens) for k in (1, args.n_choices))
                print(f"{name}: one request of n={args.n_choices} choices takes x{n / one:.2f} the time of n=1 "
                      f"({n:.3f} s vs {one:.3f} s, medians of 5)", flush=True)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="latest", help="as for `chatpipe serve --model`")
    p.add_argument("--device", default="auto")
    p.add_argument("--baseline", required=True, help="root of another tree (a checkout of the commit to compare)")
    p.add_argument("--batch-rows", type=int, default=16, help="rows of the continuous batch, on both servers")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="replies per client at each level")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrency levels, in order (default: 1 8)")
    p.add_argument("--repeats", type=int, default=1, help="times each server runs each level, taking turns")
    p.add_argument("--n-choices", type=int, default=4, help="then time one request of this n against n=1 (0: skip)")
    p.add_argument(
        "--threaded-clients", action="store_true", help="one thread and one connection per reply (the older clients)"
    )
    args = p.parse_args()
    if any(c < 1 for c in args.clients) or args.batch_rows < 1 or args.repeats < 1:
        p.error(
            f"--clients {args.clients}, --batch-rows {args.batch_rows}, --repeats {args.repeats}: each must be >= 1"
        )
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    results = measure(args)
    for clients in args.clients:
        ratios = []
        for (t0, a50, a99), (t1, b50, b99) in zip(results["baseline"][clients], results["this"][clients]):
            ratios.append(t1 / t0)
            print(
                f"{clients} client(s), this / baseline: tokens/s x{t1 / t0:.2f}, "
                f"first-token p50 x{b50 / a50:.2f}, p99 x{b99 / a99:.2f}"
            )
        if len(ratios) > 1:
            print(
                f"{clients} client(s), tokens/s this / baseline over {len(ratios)} turns: median x{statistics.median(ratios):.2f}, lowest x{min(ratios):.2f}"
            )


if __name__ == "__main__":
    main()
