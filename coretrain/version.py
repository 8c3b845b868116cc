"""The package version: a leaf module, so modules of the core need not import the package root for it."""

__version__ = "1.0.0"
