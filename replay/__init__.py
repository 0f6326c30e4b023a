"""The model of the runtime's read path on NVMe storage, its stall metrics, and the gate."""
