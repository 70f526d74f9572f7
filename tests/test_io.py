"""chatpipe.io's YAML reader (libyaml) and the dvc.lock hashes built on it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from chatpipe.io import load_yaml
from chatpipe.settings import ParamsError
from chatpipe.settings.params import read_yaml
from chatpipe.tracking import dvc_stage_hash, dvc_stage_hashes

REPO = Path(__file__).resolve().parents[1]
LOCK = """\
schema: '2.0'
stages:
  data:
    cmd: python -m chatpipe.launch data
    outs:
    - path: artifacts/data
      md5: 0c1f.dir
      size: 123
  tokenizer:
    cmd: python -m chatpipe.launch tokenizer
    params:
      params.yaml:
        tokenizer.vocab_size: 1024
"""


@pytest.mark.parametrize("name", ["params.yaml", "profiles.yaml", "dvc.yaml"])
def test_load_yaml_reads_the_repos_files_as_safe_load_does(name):
    text = (REPO / name).read_text()
    assert load_yaml(text) == yaml.safe_load(text)


def test_load_yaml_uses_libyaml_where_pyyaml_has_it():
    import chatpipe.io

    assert chatpipe.io._SAFE_LOADER is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)


def test_load_yaml_refuses_python_tags():
    with pytest.raises(yaml.YAMLError):
        load_yaml("x: !!python/object/apply:os.system ['true']")


def test_bad_params_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("pretrain:\n  depth: 4\n  lr: [1, 2\n")
    with pytest.raises(ParamsError, match=rf"{path}:\d+: not valid YAML"):
        read_yaml(path)


def test_stage_hashes_from_one_read_equal_each_stages_hash(tmp_path):
    lock = tmp_path / "dvc.lock"
    lock.write_text(LOCK)
    hashes = dvc_stage_hashes(lock)
    assert hashes == {s: dvc_stage_hash(s, lock) for s in ("data", "tokenizer")}
    entry = yaml.safe_load(LOCK)["stages"]["data"]
    assert hashes["data"] == hashlib.sha256(repr(entry).encode()).hexdigest()[:12]
    assert dvc_stage_hash("eval", lock) == "none" and dvc_stage_hashes(tmp_path / "missing") == {}
