"""Tests for chatpipe.cli: the `chatpipe` console script dispatches to each command's main."""

from __future__ import annotations

import pytest

from chatpipe import cli


def test_subcommands_dispatch_their_arguments(monkeypatch):
    seen = {}
    monkeypatch.setattr("chatpipe.serve.chat.main", lambda argv: seen.setdefault("chat", argv) and 0)
    assert cli.main(["chat", "--model", "sft", "-p", "hi"]) == 0
    assert seen["chat"] == ["--model", "sft", "-p", "hi"]


def test_help_lists_commands_and_each_command_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and "chat" in (out := capsys.readouterr().out) and "serve" in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "--batch-rows" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["plot"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_chat_refuses_what_cannot_fit_with_a_message_not_a_traceback(tmp_path, params_file, monkeypatch, capsys):
    """issue 46: a too-long prompt or --max-tokens past the context ended in a ContextTooLong traceback,
    and -t 1e-50 crashed (its logits underflowed to NaN)."""
    from chatpipe.testing.chatmodel import make_artifacts

    make_artifacts(tmp_path / "artifacts")
    monkeypatch.chdir(tmp_path)
    chat = ["chat", "--model", "sft", "--device", "cpu"]
    assert cli.main([*chat, "-p", "Mia and Pip " * 2000, "--max-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chatpipe chat: conversation is ") and "2560-token context" in err and "Traceback" not in err
    assert cli.main([*chat, "-p", "hi", "--max-tokens", "8192"]) == 2
    assert "--max-tokens 8192 leaves no room" in capsys.readouterr().err
    assert cli.main([*chat, "-p", "hi", "-t", "1e-50", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
