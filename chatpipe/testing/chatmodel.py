"""A tiny chat model for the CLI / server / browser tests, built in seconds with no download.

``make_artifacts(root)`` writes ``root/tokenizer`` (BPE trained on tiny-world text) and
``root/sft`` (a randomly initialised 2-layer GPT saved with save_model_dir), laid out like the
pipeline's ``artifacts/``. The model never emits special tokens, so every reply runs to
``max_tokens``: lengths are predictable and greedy (temperature 0) replies are deterministic.
``ByteTokenizer`` is a tokenizer stand-in for engine tests and benches that need no BPE at all.
``run_in_thread(app)`` serves an app on a free local port for the server and browser tests.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from chatpipe.data.synthetic import pretrain_documents
from chatpipe.model.files import save_model_dir
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.settings import ServeSettings
from chatpipe.tokenizer import SPECIAL_TOKENS, Tokenizer


class ByteTokenizer:
    """Stand-in tokenizer: ids 0..255 are bytes, 256.. are the chat specials (SPECIAL_TOKENS order)."""

    def __init__(self) -> None:
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.bos_id = self.special["<|bos|>"]

    def encode_special(self, name: str) -> int:
        return self.special[name]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def make_artifacts(root: Path, seed: int = 0, sequence_len: int = 256) -> Path:
    """Write tokenizer + a random ``sft`` model under ``root``; returns ``root``."""
    tok = Tokenizer.train(pretrain_documents(seed, 200), vocab_size=512)
    tok.save(root / "tokenizer")
    config = GPTConfig(
        sequence_len=sequence_len, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=64
    )
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():  # non-trivial blocks and clear logit margins (zero-init would be an identity)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        # logit 0, never the max: special tokens (so no reply ends early) and tokens that are not
        # printable ASCII (so replies read as words in the screenshot)
        unreadable = [
            i
            for i in range(tok.vocab_size)
            if not all(32 <= c < 127 for c in tok.enc.decode_single_token_bytes(i)) or i >= tok.bos_id
        ]
        model.lm_head.weight[[tok.encode_special(s) for s in SPECIAL_TOKENS] + unreadable] = 0.0
    save_model_dir(root / "sft", model, {"model_config": config.to_dict(), "stage": "sft", "step": 7})
    return root


def run_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """Start uvicorn in a daemon thread; returns (server, base_url).

    Stop it with ``server.should_exit = True``. Port 0 picks a free port.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, f"http://{host}:{bound}"


def serve_settings(**kw) -> ServeSettings:
    """ServeSettings from code defaults + ``kw`` (no params.yaml, no env), for tests."""
    return ServeSettings.model_construct(**kw)


class Paced:
    """A model's forward that takes at least ``seconds`` (a module-level class, so the server's batch
    process, which gets the model pickled, runs it paced too)."""

    def __init__(self, forward, seconds: float) -> None:
        self.forward, self.seconds = forward, seconds

    def __call__(self, *args, **kw):
        time.sleep(self.seconds)
        return self.forward(*args, **kw)


def serve_paced(loaded, cfg: ServeSettings, seconds_per_token: float = 0.005):
    """``create_app`` over ``loaded`` whose forward takes >= ``seconds_per_token``, like a real model (replies
    overlap in time), served in a thread: yields (app, url), stops the server after."""
    from chatpipe.serve.app import create_app

    loaded.model.forward = Paced(loaded.model.forward, seconds_per_token)
    app = create_app(loaded, cfg)
    srv, url = run_in_thread(app)
    yield app, url
    srv.should_exit = True
