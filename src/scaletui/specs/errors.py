"""The spec loaders' one error type (its own module, so the config readers beside the loader
can raise it without importing the loader)."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec file is missing, unreadable or has a bad key."""
