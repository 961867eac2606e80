"""The errors a user sees as one line (exit code 2), below every other module so that any of
them may raise one without importing what raises it elsewhere."""

from __future__ import annotations


class ConfigError(ValueError):
    """An impossible or malformed configuration (reported as one line, exit code 2)."""
