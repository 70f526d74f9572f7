"""The one error type of bad settings (its own module, so the file readers and the models share it)."""

from __future__ import annotations


class ParamsError(ValueError):
    """A params.yaml / profiles.yaml / env / CLI value that is not allowed; the message names the
    file (or variable, or flag), the key and the value."""
