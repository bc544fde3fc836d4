"""harmpi's version (one place: the package, harmpi.info() and pyproject.toml say it)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
