"""Reading a ``.json``, ``.yaml`` or ``.yml`` config file into the raw mapping that load.py
checks."""

import json
import re
from pathlib import Path
from typing import Any

import yaml

from zerotrain.config.errors import ConfigError

__all__ = ["read_config_file"]


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` and ``5e8`` as numbers, as JSON and YAML 1.2 do
    (PyYAML's YAML 1.1 rules need a dot and would return the string "5e8")."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed refuses duplicate keys too; json.loads would silently keep the last one.
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw mapping of a ``.json``/``.yaml``/``.yml`` config file; ``ConfigError`` if it
    cannot be read or parsed."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"{path}: not a .json, .yaml or .yml file; rename it, or pass the config as a dict"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc})") from None
    try:
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        else:
            data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if suffix == ".json" else "YAML"
        raise ConfigError(f"{path}: not valid {kind} ({exc}); fix the file syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of config keys, got {type(data).__name__}"
        )
    return data
