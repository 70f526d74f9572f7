"""A local Hugging Face hub for air-gapped runs and tests: small dataset repos served by olah on 127.0.0.1.

    python scripts/hub_mirror.py                       # build from ../shared/data into /tmp, serve on a free port
    python scripts/hub_mirror.py --data ../shared/data --root /tmp/hubmirror --port 8090
    # then, in another shell:
    HF_ENDPOINT=http://127.0.0.1:8090 python -m flows.pipeline --profile rehearsal

Builds, from the real test data in ``../shared/data``, dataset repos in the hub's layout and
schemas under the repo ids chatpipe's hf paths use:

| repo | configs / files | made from |
|---|---|---|
| karpathy/fineweb-edu-100b-shuffle | ``shard_00000.parquet`` ... (``text``) | tinyshakespeare, paragraphs packed into ~2,000-char documents |
| HuggingFaceTB/smoltalk | ``all``: ``data/all/{train,test}-*.parquet`` (``messages``, ``source``) | the 175 Alpaca seed tasks |
| cais/mmlu | ``all`` (test/validation/dev/auxiliary_train), ``auxiliary_train`` (one ``train`` struct column) | CORE openbook_qa (all), CORE ARC (auxiliary_train) |
| allenai/ai2_arc | ``ARC-Easy``, ``ARC-Challenge``: train/test/validation (``id``, ``question``, ``choices{text,label}``, ``answerKey``) | CORE arc_easy / arc_challenge |
| openai/gsm8k | ``main``: train/test (``question``, ``answer``) | GSM8K as is |
| chatpipe/eval_bundle | ``eval_bundle.zip`` (``eval_bundle/eval_data/<category>/<task>.jsonl``) | the 14 CORE tasks |

The content of MMLU and SmolTalk are stand-ins with the hub's schemas (the real sets are not in
``../shared/data``). Each repo is a plain git repo with one commit on ``main`` (fixed author dates,
so the commit shas are the same on every build) and a README.md whose YAML ``configs`` section
maps config and split to files, as on the hub.

olah 0.5.4 serves them with ``offline = true``; it listens on 127.0.0.1 only. :class:`Mirror` starts
it in its own process group and stops it by that group; the tests use it the same way.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from chatpipe.data.sources import _txt_documents
from chatpipe.data.synthetic import split_of

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_DATA = ROOT.parent / "shared" / "data"
PRETRAIN_REPO = "karpathy/fineweb-edu-100b-shuffle"
BUNDLE_REPO = "chatpipe/eval_bundle"
BUNDLE_URL = f"hf://datasets/{BUNDLE_REPO}/eval_bundle.zip"
GIT_DATE = "2026-01-01T00:00:00+00:00"  # fixed, so every build gives the same commit shas
# Category folders of the published CORE bundle (llm-foundry's eval_data layout).
CORE_CATEGORIES = {
    "world_knowledge": ["jeopardy_all", "bigbench_qa_wikidata", "arc_easy", "arc_challenge"],
    "commonsense_reasoning": ["copa", "commonsense_qa", "piqa", "openbook_qa"],
    "language_understanding": ["lambada_openai", "winograd_wsc"],
    "symbolic_problem_solving": [
        "bigbench_dyck_languages",
        "bigbench_cs_algorithms",
        "bigbench_operators",
        "bigbench_repeat_copy_logic",
    ],
}


# ---------------------------------------------------------------------- building repos


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=1024)


def _card(configs: list[dict[str, Any]]) -> str:
    import yaml

    return "---\n" + yaml.safe_dump({"configs": configs}, sort_keys=False) + "---\n\nBuilt by scripts/hub_mirror.py.\n"


def _files(prefix: str, splits: list[str]) -> dict[str, Any]:
    return {"data_files": [{"split": s, "path": f"{prefix}/{s}-*"} for s in splits]}


def build_pretrain(data: Path, repo: Path, num_shards: int) -> None:
    """tinyshakespeare as ``num_shards`` FineWeb-Edu-style parquet shards (one ``text`` column)."""
    docs = list(_txt_documents((data / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")))
    per = -(-len(docs) // num_shards)
    for i in range(num_shards):
        _parquet(
            repo / f"shard_{i:05d}.parquet", pa.table({"text": pa.array(docs[i * per : (i + 1) * per], pa.string())})
        )


def build_smoltalk(data: Path, repo: Path) -> None:
    """Alpaca seed tasks as SmolTalk ``messages`` rows (config ``all``, splits train/test)."""
    rows: dict[str, list] = {"train": [], "test": []}
    for task in _jsonl(data / "conversations" / "alpaca_seed_tasks.jsonl"):
        for inst in task["instances"]:
            user = task["instruction"] + (f"\n\n{inst['input']}" if inst["input"] else "")
            msgs = [{"content": user, "role": "user"}, {"content": inst["output"], "role": "assistant"}]
            rows["test" if split_of(user) == "test" else "train"].append({"messages": msgs, "source": "alpaca-seed"})
    schema = pa.schema(
        [("messages", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))), ("source", pa.string())]
    )
    for split, r in rows.items():
        _parquet(repo / "data" / "all" / f"{split}-00000-of-00001.parquet", pa.Table.from_pylist(r, schema))
    (repo / "README.md").write_text(_card([{"config_name": "all", **_files("data/all", ["train", "test"])}]))


def _core_mc(data: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for row in _jsonl(data / "core" / f"{name}.jsonl"):
        if len(row["choices"]) == 4:  # MMLU is 4-way
            question = row["query"].removeprefix("Question:").strip()
            out.append({"question": question, "subject": name, "choices": row["choices"], "answer": row["gold"]})
    return out


def build_mmlu(data: Path, repo: Path) -> None:
    """MMLU schema: ``all`` (test/validation/dev/auxiliary_train) and ``auxiliary_train`` (nested ``train``)."""
    schema = pa.schema(
        [
            ("question", pa.string()),
            ("subject", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("answer", pa.int64()),
        ]
    )
    obqa = _core_mc(data, "openbook_qa")
    splits = {"test": [], "validation": [], "dev": []}
    for row in obqa:
        s = {"test": "test", "val": "validation", "train": "test"}[split_of(row["question"])]
        splits["dev" if s == "validation" and len(splits["dev"]) < 5 else s].append(row)
    splits["auxiliary_train"] = _core_mc(data, "arc_easy") + _core_mc(data, "arc_challenge")
    for split, rows in splits.items():
        _parquet(repo / "all" / f"{split}-00000-of-00001.parquet", pa.Table.from_pylist(rows, schema))
    nested = pa.schema([("train", pa.struct(list(schema)))])
    aux = pa.Table.from_pylist([{"train": r} for r in splits["auxiliary_train"]], nested)
    _parquet(repo / "auxiliary_train" / "train-00000-of-00001.parquet", aux)
    (repo / "README.md").write_text(
        _card(
            [
                {"config_name": "all", **_files("all", ["auxiliary_train", "test", "validation", "dev"])},
                {"config_name": "auxiliary_train", **_files("auxiliary_train", ["train"])},
            ]
        )
    )


def build_arc(data: Path, repo: Path) -> None:
    """ARC-Easy / ARC-Challenge in the hub schema, split 80/10/10 by the same question hash as the local loader."""
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("question", pa.string()),
            ("choices", pa.struct([("text", pa.list_(pa.string())), ("label", pa.list_(pa.string()))])),
            ("answerKey", pa.string()),
        ]
    )
    configs = []
    for subset, config in (("easy", "ARC-Easy"), ("challenge", "ARC-Challenge")):
        splits: dict[str, list] = {"train": [], "validation": [], "test": []}
        for i, row in enumerate(_jsonl(data / "core" / f"arc_{subset}.jsonl")):
            question = row["query"].removeprefix("Question:").strip()
            labels = [chr(ord("A") + j) for j in range(len(row["choices"]))]
            split = {"train": "train", "val": "validation", "test": "test"}[split_of(question)]
            splits[split].append(
                {
                    "id": f"{config}-{i}",
                    "question": question,
                    "choices": {"text": row["choices"], "label": labels},
                    "answerKey": labels[row["gold"]],
                }
            )
        for split, rows in splits.items():
            _parquet(repo / config / f"{split}-00000-of-00001.parquet", pa.Table.from_pylist(rows, schema))
        configs.append({"config_name": config, **_files(config, ["train", "test", "validation"])})
    (repo / "README.md").write_text(_card(configs))


def build_gsm8k(data: Path, repo: Path) -> None:
    """GSM8K ``main`` config, train/test, unchanged rows."""
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    for split in ("train", "test"):
        rows = [{"question": r["question"], "answer": r["answer"]} for r in _jsonl(data / "gsm8k" / f"{split}.jsonl")]
        _parquet(repo / "main" / f"{split}-00000-of-00001.parquet", pa.Table.from_pylist(rows, schema))
    (repo / "README.md").write_text(_card([{"config_name": "main", **_files("main", ["train", "test"])}]))


def build_bundle(data: Path, repo: Path) -> None:
    """The CORE tasks as ``eval_bundle.zip`` in the published bundle's layout (fixed timestamps: same bytes each build)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for category, names in CORE_CATEGORIES.items():
            for name in names:
                info = zipfile.ZipInfo(f"eval_bundle/eval_data/{category}/{name}.jsonl", (2026, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, (data / "core" / f"{name}.jsonl").read_bytes())
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "eval_bundle.zip").write_bytes(buf.getvalue())


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_DATE": GIT_DATE,
        "GIT_COMMITTER_DATE": GIT_DATE,
        "GIT_AUTHOR_NAME": "hub mirror",
        "GIT_AUTHOR_EMAIL": "mirror@chatpipe.local",
        "GIT_COMMITTER_NAME": "hub mirror",
        "GIT_COMMITTER_EMAIL": "mirror@chatpipe.local",
    }
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def build_repos(data: Path, root: Path, num_shards: int = 4) -> dict[str, str]:
    """Build every repo under ``root/datasets/<org>/<name>`` as a git repo committed on ``main``.

    Returns {repo id: commit sha}. An existing ``root`` is rebuilt from scratch.
    """
    data = Path(data)
    if not (data / "gsm8k" / "train.jsonl").is_file():
        raise FileNotFoundError(f"{data}: not the shared test data folder (no gsm8k/train.jsonl)")
    builders = {
        PRETRAIN_REPO: lambda r: build_pretrain(data, r, num_shards),
        "HuggingFaceTB/smoltalk": lambda r: build_smoltalk(data, r),
        "cais/mmlu": lambda r: build_mmlu(data, r),
        "allenai/ai2_arc": lambda r: build_arc(data, r),
        "openai/gsm8k": lambda r: build_gsm8k(data, r),
        BUNDLE_REPO: lambda r: build_bundle(data, r),
    }
    commits = {}
    for repo_id, build in builders.items():
        repo = Path(root) / "datasets" / repo_id
        if repo.exists():
            subprocess.run(["rm", "-rf", str(repo)], check=True)
        repo.mkdir(parents=True)
        build(repo)
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", f"{repo_id} built from shared test data")
        commits[repo_id] = _git(repo, "rev-parse", "HEAD")
    return commits


# ---------------------------------------------------------------------- serving


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mirror:
    """olah serving ``root`` on 127.0.0.1:``port`` offline; a context manager that stops what it started.

    ``public_netloc`` is the host:port clients reach it by (a proxy in front of it); olah writes it
    into any absolute URL it returns.
    """

    def __init__(self, root: Path, port: int = 0, public_netloc: str | None = None, log_path: Path | None = None):
        self.root = Path(root)
        self.port = port or free_port()
        self.public_netloc = public_netloc or f"127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else self.root / "olah.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> Mirror:
        cfg = self.root / "olah.toml"
        cfg.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            f"port = {self.port}\n"
            f'repos-path = "{self.root / "olah_cache"}"\n'
            'mirror-scheme = "http"\n'
            f'mirror-netloc = "{self.public_netloc}"\n'
            f'mirror-lfs-netloc = "{self.public_netloc}"\n'
            f'mirrors-path = ["{self.root}"]\n'
            "[accessibility]\n"
            "offline = true\n"  # never reach for huggingface.co
        )
        exe = Path(sys.executable).parent / "olah-cli"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from olah.server import cli; cli()"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*cmd, "-c", str(cfg)], cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        probe = f"{self.url}/api/datasets/{PRETRAIN_REPO}/revision/main"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(probe, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"olah did not answer {probe} within {timeout_s}s; log: {self.log_path}")

    def stop(self) -> None:
        """SIGTERM olah's process group (it may fork workers), SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> Mirror:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
