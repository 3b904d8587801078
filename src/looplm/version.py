"""The package version (a leaf module: hf/remote, run/provenance and the importers read it without importing
the package root, which registers the Hugging Face classes when transformers is loaded)."""

__version__ = "0.1.0"
