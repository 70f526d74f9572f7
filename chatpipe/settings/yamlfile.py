"""Settings files read strictly: UTF-8 text only, and no key given twice in one mapping.

PyYAML keeps the last of two equal keys without a word, so a second ``pretrain:`` block replaced the
first; :func:`read_settings_yaml` refuses it, naming both lines. Used for params.yaml, profiles.yaml
and sweep files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from chatpipe.settings.errors import ParamsError

_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a mapping that names one key twice (merge keys ``<<`` excepted)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key_node.value, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def decode_utf8(path: Path, data: bytes) -> str:
    """``data`` as text, or a ParamsError naming the file and the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ParamsError(
            f"{path}:{line}: not UTF-8 text (byte {e.start} is {data[e.start : e.start + 1]!r}); "
            "a settings file must be UTF-8 YAML"
        ) from None


def read_settings_yaml(path: Path) -> Any:
    """Parse one YAML settings file; every error is a ParamsError naming ``path`` (and the line)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ParamsError(f"{path}: cannot read: {e.strerror or e}") from None
    text = decode_utf8(path, data)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ParamsError(
            f"{path}:{e.second}: key {e.key!r} given twice (first at line {e.first}); "
            "YAML would keep only the last: merge them into one"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ParamsError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except (ValueError, OverflowError, RecursionError) as e:  # e.g. a timestamp out of range
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
