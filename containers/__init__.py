"""Bytes: safetensors and colibrì container I/O, physical layouts, manifests, the rewriter, the verifier."""

__version__ = "0.1.0"
"""The tool's version (recorded in plans, gate records and manifests); one place for all packages."""
