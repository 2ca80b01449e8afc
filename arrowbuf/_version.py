"""The package version: one place that `arrowbuf.__init__`, pyproject.toml and the file writers read."""

__version__ = "0.1.0"
