"""A tiny GPT trained for a few seconds on tiny-world text, for the export / OpenAI API / lm-eval tests.

``train_artifacts(root)`` writes ``root/tokenizer`` and the same trained model as ``root/base`` and
``root/sft`` (laid out like the pipeline's ``artifacts/``). The model has grouped-query attention
(2 heads, 1 kv head) so the export covers GQA, and is trained (not random) so its logits have
the structure of a real model: ties are rare and greedy text reads like the training data.
"""

from __future__ import annotations

from pathlib import Path

import torch

from chatpipe.data.synthetic import pretrain_documents
from chatpipe.model.files import save_model_dir
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.tokenizer import Tokenizer


def train_artifacts(root: Path, steps: int = 40, seed: int = 0) -> Path:
    """Tokenizer + a 2-layer GPT trained ``steps`` AdamW steps on tiny-world documents; returns ``root``."""
    docs = pretrain_documents(seed, 300)
    tok = Tokenizer.train(docs, vocab_size=512)
    tok.save(root / "tokenizer")
    config = GPTConfig(sequence_len=128, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    stream = [i for ids in tok.encode(docs, prepend=tok.bos_id) for i in ids]
    data = torch.tensor(stream[: (len(stream) // 65) * 65]).view(-1, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        rows = data[torch.randint(len(data), (16,), generator=gen)]
        loss = model(rows[:, :-1], rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    for stage in ("base", "sft"):
        meta = {"model_config": config.to_dict(), "stage": stage, "step": steps, "final_loss": loss.item()}
        save_model_dir(root / stage, model, meta)
    return root


def speedrun_model(vocab_size: int, seed: int = 0, **shape) -> GPT:
    """A random d2 GPT with every option of the ``speedrun`` profile (SSSL quarter windows, value
    embeddings, lambdas, smear, backout, q/k scale, vocab padding), GQA (4 heads, 2 kv heads) and a
    512-token context so the 128-token window matters. ``vocab_size`` is rounded to 64k + 5 so the
    padding is real. Every parameter is perturbed (std 0.05) after init: the zero-initialised
    gates, lambdas and output projections would otherwise hide whole paths from a comparison.
    ``shape`` overrides the pretrain settings (depth, window_pattern, ...)."""
    from chatpipe.io import env_set
    from chatpipe.settings import PretrainSettings, load_section
    from chatpipe.train.pretrain_plan import model_config_for

    with env_set(CHATPIPE_PROFILE="speedrun"):  # the environment as it was for the tests that follow
        settings = load_section(
            PretrainSettings, {"depth": 2, "sequence_len": 512, "head_dim": 32, "n_kv_head": 2, **shape}
        )
    config = model_config_for(settings, -(-vocab_size // 64) * 64 + 5)
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()
