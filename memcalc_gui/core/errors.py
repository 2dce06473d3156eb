"""The error hierarchy: every message names the field it is about, on one line of bounded length."""

from __future__ import annotations

import re
from typing import Final

#: Longest message a user is shown (a list of every transformers config class runs to 12,000 characters).
MAX_MESSAGE_CHARS: Final = 400


def one_line(text: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` as one line: whitespace runs (newlines included) become one space, control characters are
    dropped, and anything past ``limit`` characters is cut with an ellipsis."""
    s = re.sub(r"\s+", " ", str(text))
    s = "".join(ch for ch in s if ch.isprintable()).strip()
    return s if len(s) <= limit else s[: limit - 1].rstrip() + "…"


class MemcalcError(Exception):
    """Base of every error memcalc raises on purpose; its message is always one bounded line."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (one_line(args[0]), *args[1:])
        super().__init__(*args)


class InputError(MemcalcError, ValueError):
    """A user-supplied value is invalid; ``field`` names the input (CLI flag or setup field)."""

    def __init__(self, field: str, message: str) -> None:
        field, message = one_line(field, 80), one_line(message)
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class ConfigError(InputError):
    """A model ``config.json`` is malformed, incomplete or of an unsupported family."""


class UnsupportedFamilyError(ConfigError):
    """The config's ``model_type`` is not one the analytic estimator implements."""

    def __init__(self, model_type: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            "model_type",
            f"unsupported model family {model_type!r}; supported: {', '.join(supported)}",
        )
        self.model_type = model_type


class ResourceError(MemcalcError):
    """A bundled resource (preset, GPU table, font) could not be found or read."""
