"""The package version (read by pyproject.toml and written into every export's provenance)."""

__version__ = "0.1.0"
