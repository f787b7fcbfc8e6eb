"""Read a config: dataclass defaults <- TOML file <- `--section.key value` overrides, then check it.

Every mistake a user can make here raises UserError with one message naming the key; train.py
prints it as `error: ...` and exits with code 2.
"""

import dataclasses
import difflib
import json
import sys
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from configs.errors import UserError
from configs.schema import JobConfig

USAGE = (
    "usage: train.py [--config FILE.toml] [--section.key VALUE | --section.key=VALUE ...]\n"
    "Every key is listed, with its default and meaning, in docs/configuration.md."
)


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig for a command line such as `--config x.toml --training.steps 10`."""
    config_file, overrides = _split_argv(argv)
    config = JobConfig()
    if config_file is not None:
        for section, values in _read_toml(config_file).items():
            _apply_section(config, section, values, source=config_file)
    for key, raw in overrides:
        section, name = _resolve_key(config, key)
        _set_value(config, section, name, raw, from_cli=True)
    check_values(config)
    return config


def _split_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str | None]]]:
    """Split argv into the --config file and (key, raw value) overrides; None = bare flag."""
    config_file = None
    overrides: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument '{arg}' (options look like --section.key VALUE)")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            next_arg = argv[i + 1] if i + 1 < len(argv) else None
            if next_arg is None or next_arg.startswith("--"):
                value = None  # bare flag such as --metrics.enable_tensorboard
            else:
                value = next_arg
                i += 1
        if key == "config":
            if value is None:
                raise UserError("--config needs a file name")
            config_file = value
        else:
            overrides.append((key, value))
        i += 1
    return config_file, overrides


def _read_toml(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file '{path}' does not exist")
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML files are UTF-8
        byte = e.object[e.start]
        raise UserError(f"{path} is not a UTF-8 text file (byte {e.start} is {byte:#04x})") from None


def _sections(config: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _close_match(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _apply_section(config: JobConfig, section: str, values: Any, source: str) -> None:
    sections = _sections(config)
    if section not in sections:
        hint = _close_match(section, list(sections))
        raise UserError(f"unknown section [{section}] in {source}{hint}")
    if not isinstance(values, dict):
        raise UserError(f"'{section}' in {source} must be a [section] table, not a value")
    for name, value in values.items():
        _resolve_key(config, f"{section}.{name}")
        _set_value(config, section, name, value, from_cli=False)


def _resolve_key(config: JobConfig, key: str) -> tuple[str, str]:
    """Check that `section.name` exists; suggest the closest key if it does not."""
    sections = _sections(config)
    all_keys = [f"{s}.{f.name}" for s, obj in sections.items() for f in dataclasses.fields(obj)]
    section, dot, name = key.partition(".")
    if not dot or section not in sections:
        raise UserError(f"unknown option '--{key}'{_close_match(key, all_keys)}")
    if name not in {f.name for f in dataclasses.fields(sections[section])}:
        raise UserError(f"unknown key '{key}'{_close_match(key, all_keys)}")
    return section, name


def _set_value(config: JobConfig, section: str, name: str, value: Any, from_cli: bool) -> None:
    obj = getattr(config, section)
    annotation = typing.get_type_hints(type(obj))[name]
    setattr(obj, name, _convert(value, annotation, f"{section}.{name}", from_cli))


def _convert(value: Any, annotation: Any, key: str, from_cli: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its annotated type."""
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            listed = ", ".join(repr(c) for c in choices)
            hint = _close_match(str(value), list(choices))
            raise UserError(f"{key} must be one of {listed}, got {value!r}{hint}")
        return value
    if typing.get_origin(annotation) is list:
        (item_type,) = typing.get_args(annotation)
        if from_cli:
            value = _parse_cli_list(value, key)
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, got {value!r}")
        return [_convert(v, item_type, key, from_cli) for v in value]
    if from_cli:
        value = parse_scalar(value, annotation, key)
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, str):
        return value
    raise UserError(f"{key} must be {_type_name(annotation)}, got {value!r}")


def parse_scalar(raw: str | None, annotation: Any, key: str) -> Any:
    """A command-line string as an int, float, bool or str (bool: a bare flag means true)."""
    if annotation is bool:
        if raw is None:
            return True
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise UserError(f"{key} must be true or false, got '{raw}'")
    if raw is None:
        raise UserError(f"--{key} needs a value")
    try:
        if annotation is int:
            return int(raw)
        if annotation is float:
            return float(raw)
    except ValueError:
        raise UserError(f"{key} must be {_type_name(annotation)}, got '{raw}'") from None
    return raw


def _parse_cli_list(raw: str | None, key: str) -> list[Any]:
    """A list on the command line: TOML syntax `[1, 2]` / `["a"]`, or comma-separated `a,b`."""
    if raw is None:
        raise UserError(f"--{key} needs a value")
    if raw.strip().startswith("["):
        try:
            return tomllib.loads(f"value = {raw}")["value"]
        except tomllib.TOMLDecodeError:
            raise UserError(f"{key}: '{raw}' is not a valid TOML list") from None
    return [item.strip() for item in raw.split(",") if item.strip()]


def _type_name(annotation: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        annotation, str(annotation)
    )


def check_values(config: JobConfig) -> None:
    """Each section's range checks (schema.py, next to its fields)."""
    for name, section in _sections(config).items():
        section.check(name)


def config_to_toml(config: JobConfig) -> str:
    """Render the resolved config as TOML that load_config reads back to the same values."""
    lines = []
    for section, obj in _sections(config).items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
