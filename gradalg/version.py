"""The package version (the lowest floor: anything may import it)."""

__version__ = "0.1.0"
