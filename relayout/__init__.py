"""relayout: co-activation layouts for MoE expert containers streamed from NVMe."""

__version__ = "0.1.0"
