"""dvc.yaml's code deps are each stage's import closure: a drift fails here, and DVC really sees edits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chatpipe.lineage import import_closure, stage_code_deps, stale_deps
from chatpipe.testing.project import make_project, run

REPO = Path(__file__).resolve().parents[1]


def dvc_stage_names(root: Path) -> list[str]:
    import yaml

    return list(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])


def test_dvc_yaml_code_deps_match_every_stage_import_closure():
    assert stale_deps(REPO) == {}, "run `python -m chatpipe.lineage` to regenerate dvc.yaml's code deps"


def test_closure_follows_function_level_imports_package_inits_and_named_data_files(tmp_path):
    pkg = tmp_path / "chatpipe" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "chatpipe" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "late.py").write_text("X = 1\n")
    (pkg / "table.yaml").write_text("a: 1\n")
    (pkg / "early.py").write_text("def f():\n    from chatpipe.sub import late\n    return 'table.yaml'\n")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "s.py").write_text("import chatpipe.sub.early\n")
    got = [p.relative_to(tmp_path).as_posix() for p in import_closure(tmp_path, tmp_path / "stages" / "s.py")]
    assert got == [
        "chatpipe/__init__.py",
        "chatpipe/sub/__init__.py",
        "chatpipe/sub/early.py",
        "chatpipe/sub/late.py",
        "chatpipe/sub/table.yaml",
        "stages/s.py",
    ]


def test_check_fails_on_a_dropped_dep_and_on_a_new_import(tmp_path):
    project = make_project(tmp_path / "p")
    check = [sys.executable, "-m", "chatpipe.lineage", "--check"]
    assert run(project, *check).returncode == 0

    # a hand-edited dvc.yaml that lost a module the rl stage imports (the drift that once went unnoticed)
    text = (project / "dvc.yaml").read_text()
    (project / "dvc.yaml").write_text(text.replace("      - chatpipe/inference/calculator.py\n", "", 1))
    r = run(project, *check, check=False)
    assert r.returncode == 1 and "chatpipe/inference/calculator.py" in r.stderr

    # a stage that starts importing a module dvc.yaml does not list
    (project / "dvc.yaml").write_text(text)
    report = project / "stages" / "report.py"
    report.write_text(report.read_text() + "\nfrom chatpipe.data import packing  # noqa: E402,F401\n")
    r = run(project, *check, check=False)
    assert r.returncode == 1 and "'report'" in r.stderr and "chatpipe/data/packing.py" in r.stderr
    run(project, sys.executable, "-m", "chatpipe.lineage")
    assert run(project, *check).returncode == 0


@pytest.mark.slow
def test_editing_any_imported_module_marks_exactly_the_stages_that_import_it_stale(tmp_path):
    """With every stage committed, touching a module makes `dvc status` name exactly its importers."""
    import yaml

    project = make_project(tmp_path / "p")
    spec = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    for stage in spec.values():  # stand-ins for every output, so `dvc commit` records each stage as done
        for entry in [*stage.get("outs", []), *stage.get("metrics", [])]:
            out = project / (entry if isinstance(entry, str) else next(iter(entry)))
            target = out if out.suffix else out / "stub.txt"  # a path with no suffix is a directory out
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(out.name)
    run(project, "dvc", "commit", "-f", "-q")
    assert json.loads(run(project, "dvc", "status", "--json").stdout) == {}

    importers: dict[str, set[str]] = {}
    for name, stage in spec.items():
        generated = stage_code_deps(project, name) if (project / "stages" / f"{name}.py").exists() else []
        hand_listed = [
            d for d in stage.get("deps", []) if isinstance(d, str) and d.startswith(("chatpipe/", "stages/"))
        ]
        for dep in {*generated, *hand_listed}:
            importers.setdefault(dep, set()).add(name)
    assert len(importers) > 20
    # Every module touched at once: for each stage, `dvc status` lists each changed dep it has, so one
    # status (the command's answer, checked above, without a ~0.5 s pass over every dep per module)
    # says which stages each module's edit makes stale. (The project is this test's own copy: nothing
    # reads it afterwards, so the edits stay.)
    for dep in importers:
        path = project / dep
        path.write_bytes(path.read_bytes() + b"\n# touched\n")
    status = json.loads(run(project, "dvc", "status", "--json").stdout)
    stale: dict[str, set[str]] = {}
    for stage, changes in status.items():
        for change in changes:
            for dep, what in change.get("changed deps", {}).items():
                assert what == "modified", (stage, dep, what)
                stale.setdefault(dep, set()).add(stage)
    wrong = {
        dep: f"dvc status says {sorted(stale.get(dep, ()))}, imports say {sorted(importers.get(dep, ()))}"
        for dep in {*stale, *importers}
        if stale.get(dep) != importers.get(dep)
    }
    assert not wrong, wrong
