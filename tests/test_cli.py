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
    assert "--num-engines" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["plot"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
