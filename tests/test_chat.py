"""Tests for chatpipe.serve.chat: the terminal chat driven through a pseudo-terminal with pexpect."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pexpect
import pytest

from chatpipe.inference.engine import Engine
from chatpipe.model.loading import load_chat_model
from chatpipe.serve.chat import ContextTooLong, main, prompt_for, show_stream
from chatpipe.testing.chatmodel import make_artifacts
from tests.conftest import REPO


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory with artifacts/{tokenizer,sft} to run `chatpipe chat` in."""
    root = tmp_path_factory.mktemp("chat")
    make_artifacts(root / "artifacts")
    return root


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPIPE_")}
    return {**env, "CHATPIPE_PARAMS": str(REPO / "params.yaml"), "OMP_NUM_THREADS": "1", "TERM": "dumb"}


def greedy_reply(workdir, messages, max_tokens: int) -> str:
    loaded = load_chat_model("sft", artifacts=workdir / "artifacts", device="cpu")
    prompt = loaded.tokenizer.render_for_completion({"messages": messages})
    engine = Engine(loaded.model, loaded.tokenizer)
    return "".join(t for _, t in engine.stream(prompt, max_tokens=max_tokens, temperature=0.0))


def test_interactive_chat_streams_replies_and_exits(workdir):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "chatpipe.serve.chat", "--model", "sft", "-t", "0", "--max-tokens", "20"],
        cwd=str(workdir),
        env=cli_env(),
        encoding="utf-8",
        timeout=60,
    )
    try:
        child.expect(r"chatpipe chat: sft \(stage sft, step 7")
        child.expect("You: ")
        child.sendline("hello there")
        child.expect("Assistant: ")
        child.expect("\r\n\r\nYou: ")
        first = child.before
        assert first.strip() == greedy_reply(workdir, [{"role": "user", "content": "hello there"}], 20).strip()
        # second turn: the reply is conditioned on the whole conversation
        child.sendline("and then?")
        child.expect("Assistant: ")
        child.expect("\r\n\r\nYou: ")
        convo = [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": first.strip()},
            {"role": "user", "content": "and then?"},
        ]
        assert child.before.strip() == greedy_reply(workdir, convo, 20).strip()
        child.sendline("/clear")
        child.expect_exact("(new conversation)")
        child.expect("You: ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_one_shot_prompt(workdir):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "chatpipe.serve.chat", *args],
            cwd=workdir,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = run("--model", "sft", "-p", "hi", "-t", "0", "--max-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == greedy_reply(workdir, [{"role": "user", "content": "hi"}], 10).strip()


def test_a_copy_of_a_model_dir_chats_outside_any_project(workdir, tmp_path):
    # before: `chatpipe chat --model DIR` on a copy of artifacts/rl failed: artifacts/tokenizer/tokenizer.json missing
    from chatpipe.model.files import save_model_dir

    loaded = load_chat_model("sft", artifacts=workdir / "artifacts", device="cpu")
    meta = {k: v for k, v in loaded.meta.items() if k != "files"}
    save_model_dir(tmp_path / "made" / "rl", loaded.model, meta, tokenizer_dir=workdir / "artifacts" / "tokenizer")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "made" / "rl", elsewhere / "rl")
    r = subprocess.run(
        [sys.executable, "-m", "chatpipe.serve.chat", "--model", str(elsewhere / "rl"), "-p", "hi", "-t", "0"]
        + ["--max-tokens", "10"],
        cwd=elsewhere,  # no artifacts/ here
        env={**cli_env(), "PYTHONPATH": str(REPO)},  # this checkout's chatpipe, whatever the venv points at
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == greedy_reply(workdir, [{"role": "user", "content": "hi"}], 10).strip()


def test_bad_model_or_flag_is_a_clear_error(workdir, params_file, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert main(["--model", "rl", "-p", "hi"]) == 2
    assert "artifacts/rl/meta.json not found: run the `rl` stage first" in capsys.readouterr().err
    assert main(["--model", "sft", "--temperature", "-1", "-p", "hi"]) == 2
    assert "chat.temperature = -1.0" in capsys.readouterr().err


class Recorder(io.StringIO):
    """Counts writes, to see that text goes out piece by piece."""

    writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def test_show_stream_writes_each_piece_and_brackets_tool_calls():
    pieces = [
        ("text", "It is"),
        ("text", " "),
        ("python", "12+"),
        ("python", "7"),
        ("python_output", "19"),
        ("text", " apples."),
    ]
    out = Recorder()
    parts = show_stream(iter(pieces), out)
    assert out.getvalue() == "It is [calc: 12+7 = 19] apples.\n"
    assert out.writes >= len(pieces)
    assert parts == [
        {"type": "text", "text": "It is "},
        {"type": "python", "text": "12+7"},
        {"type": "python_output", "text": "19"},
        {"type": "text", "text": " apples."},
    ]


def test_prompt_that_cannot_fit_is_refused(workdir):
    loaded = load_chat_model("sft", artifacts=workdir / "artifacts", device="cpu")
    with pytest.raises(ContextTooLong, match="2560-token context"):
        prompt_for(loaded.tokenizer, loaded.model, [{"role": "user", "content": "hi"}], max_tokens=2560)
