"""Reading a process's TOML configuration file, with the file's problems named for the user."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


class TomlFileError(ValueError):
    """The file cannot be read or is not TOML; `problem` says which, for the caller's own error."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def read_toml(path: Path) -> dict[str, Any]:
    """The file's top-level table; TomlFileError when it is missing, unreadable or not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise TomlFileError(path, "file not found") from None
    except OSError as exc:
        raise TomlFileError(path, f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TomlFileError(path, f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the whole file first and lets this through
        raise TomlFileError(path, f"not valid TOML: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                            f"offset {exc.start})") from None
