"""File formats the model reads and writes, one reader and one writer each: the routing trace
(``.rlt``), ``plan.json``, the gate record (``gate.json``) and pin records. A format module checks
its input strictly and knows nothing of how the model uses it.
"""
