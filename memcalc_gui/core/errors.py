"""The error hierarchy: every message names the field it is about."""

from __future__ import annotations


class MemcalcError(Exception):
    """Base of every error memcalc raises on purpose."""


class InputError(MemcalcError, ValueError):
    """A user-supplied value is invalid; ``field`` names the input (CLI flag or setup field)."""

    def __init__(self, field: str, message: str) -> None:
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
