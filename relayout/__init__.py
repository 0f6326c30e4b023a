"""relayout: co-activation layouts for MoE expert containers streamed from NVMe."""

from containers import __version__

__all__ = ["__version__"]
