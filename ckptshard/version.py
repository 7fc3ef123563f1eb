"""The package version, apart from ``ckptshard/__init__.py`` so that any layer can read it."""

__version__ = "0.1.0"
