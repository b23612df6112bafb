"""The package version, in this one place: ``pyproject.toml`` reads it for the wheel's metadata, and
``ckptkit --version`` prints it."""

__version__ = "0.1.0"
