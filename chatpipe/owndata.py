"""``chatpipe check-data``: every file of your own that the settings name, checked before any training.

    chatpipe check-data          # exit 1 with the first problem: file, line and what was expected

The Prefect flow runs the same checks after validating the settings, before its first stage; each
stage checks its own files again when it starts. What is checked (docs/own-data.md):

- ``data.source: local``: every file of ``data.local_dir`` is read as the data stage reads it, a
  tokenizer is trained on it as the tokenizer stage would, and the corpus must hold enough text for
  ``tokenizer.vocab_size`` and survive ``decode(encode(text))``;
- every task with a ``path`` in ``midtrain.mixture``, ``sft.mixture``, ``rl.replay`` and
  ``rl.keep_tasks``, and ``rl.task`` with ``rl.task_path``: every row parses as a conversation
  (JSON, roles, non-empty text);
- ``reward_model.source: local``: every pair of ``path`` and ``val_path`` has both replies, and they
  differ;
- ``rl.reward.verifier: custom``: ``rl.reward.verifier_file`` exists, parses, imports and defines ``rl.reward.verifier_function``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from chatpipe.settings import ParamsError, StageSettings, validate_all


def check_corpus_dir(data: Any, tokenizer: Any) -> str:
    """The local corpus, through the data stage's own reader into a temp dir, then a tokenizer trained
    as the tokenizer stage trains it (:func:`chatpipe.tokenizer.check_corpus`)."""
    from chatpipe.data.sources import corpus_name, iter_documents, prepare_text
    from chatpipe.tokenizer import Tokenizer, check_corpus

    with tempfile.TemporaryDirectory(prefix="chatpipe-check-") as tmp:
        out = Path(tmp) / "data"
        manifest = prepare_text(out, **data.model_dump())
        texts, left = [], tokenizer.max_chars
        for doc in iter_documents(out, "train"):
            if left <= 0:
                break
            texts.append(doc[:left])
            left -= len(doc)
        tok = Tokenizer.train(texts, tokenizer.vocab_size)
        n_chars = sum(map(len, texts))
        check_corpus(tok, tokenizer.vocab_size, texts[: tokenizer.roundtrip_docs], corpus_name(out), n_chars)
    return f"{data.local_dir}: {manifest['num_docs']['train']} train and {manifest['num_docs']['val']} val documents"


def chat_files(settings: dict[str, StageSettings]) -> list[tuple[str, str, str]]:
    """``(setting, task, path)`` of every chat task that reads a file of the user's."""
    found = []
    for section, key in (("midtrain", "mixture"), ("sft", "mixture"), ("rl", "replay"), ("rl", "keep_tasks")):
        for i, item in enumerate(getattr(settings[section], key)):
            if item.path:
                found.append((f"{section}.{key}[{i}]", item.task, item.path))
    rl = settings["rl"]
    if rl.task_path:
        found.append(("rl.task_path", rl.task, rl.task_path))
    return found


def check_user_files(settings: dict[str, StageSettings]) -> list[str]:
    """Check every user file the settings name (module docstring); returns one line per file checked,
    raises ValueError/FileNotFoundError naming the file and line at the first problem."""
    done = []
    if settings["data"].source == "local":
        done.append(check_corpus_dir(settings["data"], settings["tokenizer"]))
    for setting, task, path in chat_files(settings):
        if Path(path).is_file():  # a dir (a hub-shaped task's local copy) is that task's to read
            from chatpipe.data.tasks import build_task

            rows = len(build_task(task, "all" if task == "customjson" else "train", path=path))
            done.append(f"{path} ({setting}): {rows} rows")
    rm = settings["reward_model"]
    if rm.source == "local":
        from chatpipe.data.preferences import check_jsonl_pairs

        for path in filter(None, (rm.path, rm.val_path)):
            done.append(f"{path} (reward_model): {check_jsonl_pairs(path)} pairs")
    rl = settings["rl"]
    if rl.reward.verifier == "custom":
        from chatpipe.rl.verifier import Verifier

        Verifier(
            rl.reward.verifier_file,
            rl.reward.verifier_function,
            sandbox=rl.reward.verifier_sandbox,
            timeout_s=rl.reward.verifier_timeout_s,
        )
        done.append(f"{rl.reward.verifier_file} (rl.reward.verifier_file): defines {rl.reward.verifier_function}")
    return done


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="chatpipe check-data", description=__doc__.split("\n")[0]).parse_args(argv)
    try:
        lines = check_user_files(validate_all())
    except (ParamsError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in lines or ["no files of your own in the settings (data.source synthetic, no task paths)"]:
        print(f"ok  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
