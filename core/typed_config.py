"""Typed values from YAML: dataclasses built from nested mappings, dotted `key=value` overrides, YAML files.

    YAML file ──read_yaml──> nested dict ──set_in_section (per override)──> nested dict ──build──> dataclass

The machinery alone, knowing nothing of what a config holds: training/config.py gives its sections (the
dataclasses), its top-level keys and its rules (the cross-field checks, the model sizes). A field's type
annotation is its check: bool, int, float (a YAML 1.1 string such as `3e-4` read as one), str, a nested
dataclass, a list or a mapping of names to one of them, or an optional one (null allowed). Every mistake
(an unknown key, a wrong type, a file missing, unreadable or not YAML, a key given twice) raises
`ConfigError` with one line that names the key or the file and what is valid.

Imports nothing of the project but errors.py and storage.py.
"""
from __future__ import annotations

import dataclasses
import pathlib
import stat
import types
import typing

import yaml

from core import storage
from core.errors import ConfigError

# ----------------------------------------------------------------------------------------------
# Typed values


def fields(cls) -> dict[str, typing.Any]:
    """Field name -> resolved type annotation (the modules use `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(tp) -> str:
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {', '.join(fields(tp))}"
    if typing.get_origin(tp) is dict:
        return f"a mapping of names to {type_name(args[1])}"
    if typing.get_origin(tp) is list:
        return f"a list of {type_name(args[0])}"
    if type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    return getattr(tp, "__name__", str(tp))


def check_value(key: str, value, tp):
    """`value` converted to the field type `tp`, or a ConfigError naming the key and the type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return check_value(key, value, inner[0]) if value is not None else _bad(key, value, tp)
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(tp):  # a nested section, e.g. training.lora
        return build(tp, value, key)
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, list):
            return [check_value(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    elif origin is dict:  # names to values, e.g. data.mixture's sources
        _, item = typing.get_args(tp)
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: check_value(f"{key}.{k}", v, item) for k, v in value.items()}
    else:
        return value
    _bad(key, value, tp)


def _bad(key, value, tp):
    raise ConfigError(f"{key} must be {type_name(tp)}, got {value!r} ({type(value).__name__})")


def mapping(raw, cls, prefix: str) -> dict:
    """A copy of the section `raw` of dataclass `cls` ({} for an absent one), or a ConfigError naming it."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix} must be a mapping of {', '.join(fields(cls))}, got {raw!r}")
    return dict(raw)


def build(cls, raw, prefix: str):
    """A dataclass `cls` from the mapping `raw`; unknown keys and wrong types are ConfigErrors."""
    raw = mapping(raw, cls, prefix)
    known = fields(cls)
    unknown = [k for k in raw if k not in known]
    if unknown:
        raise ConfigError(f"unknown key {prefix}.{unknown[0]}; valid keys of {prefix}: {', '.join(known)}")
    return cls(**{k: check_value(f"{prefix}.{k}", v, known[k]) for k, v in raw.items()})


# ----------------------------------------------------------------------------------------------
# Overrides: key=value on the command line


def parse_override(text: str, after: str | None = None, examples: typing.Mapping[str, str] | None = None
                   ) -> tuple[list[str], typing.Any]:
    """`training.lr=3e-4` -> (['training', 'lr'], 3e-4); the value is read as YAML. `after`: the override
    given after this one, to tell a list or mapping the shell split at its spaces (left unquoted).
    `examples`: key -> the override a mistake in that key's list or mapping shows (else a generic one)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. training.batch_size=64)")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError as e:
        if value.lstrip().startswith(("[", "{")):  # meant as a list or a mapping
            example = (examples or {}).get(key) or f"'{key}=[a, b]' or '{key}={{a: 1, b: 2}}'"
            if after is not None and "=" not in after:
                raise ConfigError(f"override {text!r} is cut short: the shell split its value at the spaces ({after!r} "
                                  f"came as the next override); quote the whole override, e.g. {example}") from None
            mark = getattr(e, "problem_mark", None)
            where = f" at character {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"override {text!r}: its value is not valid YAML{where} "
                              f"({getattr(e, 'problem', None) or 'unreadable'}); a list or mapping is written in "
                              f"YAML's flow style, e.g. {example} (commas between the items)") from None
        parsed = value
    return key.split("."), parsed


def _nested_section(tp):
    """The dataclass of a field typed as one (or as an optional one), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _named_sections(tp):
    """The dataclass of a field typed as a mapping of names to one (or an optional one), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if len(args) == 1 and typing.get_origin(args[0]) is dict:
        item = typing.get_args(args[0])[1]
        return item if dataclasses.is_dataclass(item) else None
    return None


def set_in_section(raw: dict, cls, path: list[str], value, text: str) -> None:
    """The override `text` (its dotted `path` and `value`) set in `raw`'s section path[0], whose dataclass
    is `cls`: SECTION.KEY=VALUE, a nested section's key (SECTION.KEY.FIELD=VALUE), or a named entry of a
    mapping of sections, whole (SECTION.KEY.NAME=VALUE, null removing it) or one key of it
    (SECTION.KEY.NAME.FIELD=VALUE). The value is checked later, when the section is built."""
    top = path[0]
    known = fields(cls)
    named = _named_sections(known.get(path[1])) if len(path) > 1 else None
    if named is not None and len(path) in (3, 4):  # data.mixture.NAME=... or data.mixture.NAME.KEY=...
        section = mapping(raw.get(top), cls, top)
        entries = section.get(path[1]) or {}
        if not isinstance(entries, dict):
            raise ConfigError(f"{top}.{path[1]} must be a mapping of names to {type_name(named)}, "
                              f"got {entries!r}")
        entries = dict(entries)
        if len(path) == 3:  # the whole entry: a mapping, or null to remove it
            if value is None:
                entries.pop(path[2], None)
            else:
                entries[path[2]] = value
        else:
            entries[path[2]] = {**mapping(entries.get(path[2]), named, f"{top}.{path[1]}.{path[2]}"),
                                path[3]: value}
        section[path[1]] = entries or None
        raw[top] = section
        return
    nested = _nested_section(known.get(path[1])) if len(path) > 1 else None
    # a section the file gives as something else (`training: 5`) is refused, never replaced
    if len(path) == 3 and nested is not None:  # one key of a nested section: training.lora.rank=16
        section = mapping(raw.get(top), cls, top)
        inner = mapping(section.get(path[1]), nested, f"{top}.{path[1]}")
        section[path[1]] = {**inner, path[2]: value}
        raw[top] = section
        return
    if len(path) != 2:
        valid = ", ".join(f"{top}.{k}" for k in known)
        raise ConfigError(f"override {text!r} must name one key of {top}; valid keys: {valid}")
    raw[top] = {**mapping(raw.get(top), cls, top), path[1]: value}


# ----------------------------------------------------------------------------------------------
# YAML files


def read_yaml(path, keys: typing.Sequence[str]) -> dict:
    """The mapping a config file holds (parse_yaml), or a ConfigError naming what the path is instead."""
    path = pathlib.Path(path)
    if not path.is_file():
        if storage.link_loop(path):
            raise ConfigError(f"config file {path}: {storage.LINK_LOOP}: mend the link, or give the YAML file itself")
        if not path.exists():
            raise ConfigError(f"config file {path} not found")
        raise ConfigError(f"config file {path} is not a regular file but {_file_kind(path)}; give a YAML file")
    try:
        return parse_yaml(path.read_bytes(), path, keys)
    except OSError as e:  # unreadable: a permission, an I/O error
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None


def _file_kind(path: pathlib.Path) -> str:
    """What a path that exists but is no regular file is, in words (read without opening it: a FIFO
    would wait for a writer, /dev/zero never end)."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "another kind of file")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error: YAML would keep the last
    silently (a second `training:` block replacing the first)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                    f"the second would silently replace the first")
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_yaml(text: str | bytes):
    """yaml.safe_load, refusing a key given twice in one mapping (yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml(text: str | bytes, path, keys: typing.Sequence[str]) -> dict:
    """The mapping of a config file's text (bytes: UTF-8 or UTF-16, as YAML allows); `path` names it in
    errors, among them bytes that are no text (yaml's ReaderError) and a key given twice; `keys`, the
    top-level keys a config has, in the error for a file that holds no mapping."""
    try:
        raw = load_yaml(text)
    except yaml.reader.ReaderError as e:  # bytes that are not text, or a control character
        what = f"byte 0x{e.character:02x}" if isinstance(e.character, int) else f"character {e.character!r}"
        raise ConfigError(f"{path} is not UTF-8 text ({what} at offset {e.position})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping with keys {', '.join(keys)}")
    return raw
