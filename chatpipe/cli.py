"""The ``chatpipe`` console script: one subcommand per module, each with its own ``main(argv)``.

Run::

    chatpipe chat [--model sft] [-p PROMPT] ...     # chatpipe/serve/chat.py
    chatpipe serve [--port 8000] ...                # chatpipe/serve/app.py
    chatpipe plan --profile speedrun                # chatpipe/train/pretrain_plan.py
    chatpipe sweep-plan sweeps/isoflop_speedrun.yaml # chatpipe/sweep/spec.py
    chatpipe export --model sft --out DIR           # chatpipe/export/hf.py
    chatpipe check-data                             # chatpipe/owndata.py
    chatpipe <command> --help                       # that command's flags

A new subcommand is one line in ``COMMANDS``; its module is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "chat": ("chatpipe.serve.chat", "talk to a trained model in the terminal"),
    "serve": ("chatpipe.serve.app", "web UI and JSON API for a trained model"),
    "plan": ("chatpipe.train.pretrain_plan", "parameters, tokens, steps, time, cost and memory of a profile"),
    "sweep-plan": ("chatpipe.sweep.spec", "validate a sweep file (sweeps/*.yaml) and price its points"),
    "check-data": ("chatpipe.owndata", "check every file of your own the settings name, before any training"),
    "lineage": ("chatpipe.lineage", "rewrite (or --check) dvc.yaml's code deps from each stage's imports"),
    "export": ("chatpipe.export.hf", "write a model as a Hugging Face transformers directory (optionally push it)"),
    "import-nanochat": ("chatpipe.model.nanochat_import", "turn a nanochat checkpoint into a chatpipe model dir"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``chatpipe <command> [args]`` to the command module's ``main``."""
    parser = argparse.ArgumentParser(prog="chatpipe", description="chatpipe command-line tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)  # the command parses (and documents) its own flags
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
