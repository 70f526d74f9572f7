"""The README and docs/*.md name only things that exist.

The layout listing (docs/layout.md, linked from the README) matches the tree (every listed module exists, every module is listed),
and in the README and every docs page each module reference (``chatpipe.x.y``, ``flows.pipeline``),
repository path (``stages/pretrain.py``, ``docs/chat-ui.png``), relative link and command
(``python -m M --flag``, ``chatpipe <command> --flag``, ``python scripts/x.py --flag``) resolves.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_FOLDERS = ("chatpipe", "stages", "flows", "tests", "bench", "scripts", "sweeps", "docs", ".ci")
MODULE_REF = re.compile(r"(?<![\w./-])((?:chatpipe|stages|flows)(?:\.\w+)+)")
TOP_FOLDER_NAMES = "|".join(re.escape(f) for f in TOP_FOLDERS)
PATH_REF = re.compile(rf"(?<![\w./-])((?:{TOP_FOLDER_NAMES})/[^\s`'\"(),;:\]]*)")
LINK_REF = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def layout_paths(text: str) -> set[str]:
    """Paths named in the first code block after the "Layout" heading, with their folders joined from
    the indentation."""
    block = text.split("# Layout", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or line.strip().startswith(("custom", "(")):
            continue
        depth, name = len(m.group(1)) // 2, m.group(2).rstrip(",")
        if not re.match(r"^[\w.]+/?$", name):
            continue
        stack = stack[:depth]
        full = "/".join([*stack, name.rstrip("/")])
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        paths.add(full)
    return paths


def test_every_listed_path_exists_and_every_module_is_listed():
    listed = layout_paths((REPO / "docs" / "layout.md").read_text())
    missing = sorted(p for p in listed if not (REPO / p).exists())
    assert not missing, f"docs/layout.md lists paths that do not exist: {missing}"
    modules = {
        p.relative_to(REPO).as_posix()
        for folder in ("chatpipe", "stages", "flows")
        for p in (REPO / folder).rglob("*.py")
        if p.name != "__init__.py" and "/tasks/" not in p.as_posix()
    }
    unlisted = sorted(m for m in modules if m not in listed)
    assert not unlisted, f"modules missing from docs/layout.md: {unlisted}"


def module_file(dotted: str, repo: Path) -> tuple[Path | None, list[str]]:
    """The source file of the longest module prefix of ``dotted`` and the names after it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = repo.joinpath(*parts[:i])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[i:]
    return None, parts


def top_level_names(source: Path) -> set[str]:
    """Names a module defines at its top level: functions, classes, assignments, imports."""
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_problem(dotted: str, repo: Path) -> str | None:
    """Why ``dotted`` (a module, or a module and one of its top-level names) does not resolve."""
    source, rest = module_file(dotted, repo)
    if source is None:
        return f"{dotted}: no such module"
    if rest and rest[0] not in top_level_names(source):
        if source.name == "__init__.py":
            return f"{dotted}: no such module"
        return f"{dotted}: {source.relative_to(repo)} defines no {rest[0]!r}"
    return None


def path_problem(ref: str, repo: Path) -> str | None:
    """Why a repository path named in the text does not exist (placeholders and globs are not checked)."""
    ref = ref.rstrip(".")
    if any(c in ref for c in "<>*{}|$") or not (ref.endswith("/") or re.search(r"\.\w+$", ref)):
        return None
    return None if (repo / ref).exists() else f"{ref}: no such path"


def link_problem(target: str, doc: Path) -> str | None:
    """Why a relative Markdown link or image does not resolve from the page that holds it."""
    target = target.split("#", 1)[0]
    if not target or re.match(r"^[a-z]+:", target):
        return None
    return None if (doc.parent / target).exists() else f"link {target}: no such file beside {doc.name}"


def command_lines(text: str) -> list[str]:
    """Lines of fenced code blocks (continuations joined) and inline code spans: where commands are written."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    return lines + CODE_SPAN.findall(prose)


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line as token lists, comments dropped, env assignments stripped."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        tokens = line.split("#", 1)[0].split()
    commands, current = [], []
    for tok in [*tokens, ";"]:
        if tok in ("&&", "||", ";", "|"):
            while current and re.match(r"^[A-Z_][A-Z0-9_]*=", current[0]):
                current.pop(0)
            if current:
                commands.append(current)
            current = []
        else:
            current.append(tok)
    return commands


def command_target(tokens: list[str], repo: Path) -> tuple[str | None, Path | None, list[str]]:
    """(what, source, args) of a chatpipe command: ``python -m M``, ``torchrun -m M``, ``python x.py``,
    ``chatpipe <command>``; (None, None, []) for any other program."""
    program = Path(tokens[0]).name
    if program == "chatpipe" and len(tokens) > 1:
        from chatpipe.cli import COMMANDS

        if tokens[1] not in COMMANDS:
            return f"chatpipe {tokens[1]}", None, []
        source, _ = module_file(COMMANDS[tokens[1]][0], repo)
        return f"chatpipe {tokens[1]}", source, tokens[2:]
    if not re.match(r"^(python3?|torchrun)$", program):
        return None, None, []
    if "-m" in tokens:
        module = tokens[tokens.index("-m") + 1]
        if module.split(".")[0] not in ("chatpipe", "stages", "flows") or "<" in module:
            return None, None, []
        source, rest = module_file(module, repo)
        return f"-m {module}", None if rest else source, tokens[tokens.index("-m") + 2 :]
    if len(tokens) > 1 and tokens[1].endswith(".py"):
        source = repo / tokens[1]
        return tokens[1], source if source.is_file() else None, tokens[2:]
    return None, None, []


def command_problems(line: str, repo: Path) -> list[str]:
    """Commands on a line that name a missing module, script or chatpipe command, or a flag it lacks."""
    problems = []
    for tokens in split_commands(line):
        what, source, args = command_target(tokens, repo)
        if what is None:
            continue
        if source is None:
            problems.append(f"{what}: no such command")
            continue
        text = source.read_text()
        args = args[: args.index("--")] if "--" in args else args  # after `--`: the stage's own flags
        for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
            if f'"{flag}"' not in text:
                problems.append(f"{what}: {source.relative_to(repo)} has no flag {flag}")
    return problems


def doc_problems(doc: Path, repo: Path = REPO) -> list[str]:
    """Every reference in a Markdown page that does not resolve, as readable lines."""
    text = doc.read_text()
    problems = [p for ref in sorted(set(MODULE_REF.findall(text))) if (p := module_problem(ref, repo))]
    unlinked = LINK_REF.sub("]", text)  # link targets are relative to the page, checked below
    problems += [p for ref in sorted(set(PATH_REF.findall(unlinked))) if (p := path_problem(ref, repo))]
    problems += [p for ref in sorted(set(LINK_REF.findall(text))) if (p := link_problem(ref, doc))]
    for line in command_lines(text):
        problems += command_problems(line, repo)
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_module_path_link_and_command_in_the_docs_exists(doc: Path):
    problems = doc_problems(doc)
    assert not problems, f"{doc.relative_to(REPO)} names things that do not exist:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in DOCS[1:] if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_checker_reports_each_kind_of_bogus_reference(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "Real: `chatpipe.runtime.keep_freed_memory_in_heap`, `stages/pretrain.py`, `chatpipe plan --gpu H100`.\n"
        "Bogus: `chatpipe.nosuch.module`, `chatpipe.runtime.no_such_function`, `stages/nosuch.py`,\n"
        "![img](nosuch.png), `chatpipe nosuch-command`.\n\n"
        "```bash\n"
        "CHATPIPE_X=1 python -m flows.pipeline --profile tiny --no-such-flag && python -m flows.nosuch\n"
        "python scripts/nosuch.py --port 1   # a comment\n"
        "python -m chatpipe.launch pretrain -- --max_steps=5\n"
        "```\n"
    )
    assert doc_problems(page) == [
        "chatpipe.nosuch.module: no such module",
        "chatpipe.runtime.no_such_function: chatpipe/runtime.py defines no 'no_such_function'",
        "flows.nosuch: no such module",
        "scripts/nosuch.py: no such path",
        "stages/nosuch.py: no such path",
        "link nosuch.png: no such file beside page.md",
        "-m flows.pipeline: flows/pipeline.py has no flag --no-such-flag",
        "-m flows.nosuch: no such command",
        "scripts/nosuch.py: no such command",
        "chatpipe nosuch-command: no such command",
    ]
