"""The compiled model of the runtime's read path: the drive array, page cache, LRU and weight
cache, read plans, prefetch and admission kernels, and the replay loop (numba) that turns a routing
trace into per-step stall. Its compiled build is cached under a digest of this package's sources
(:func:`replay.compiled.source_digest`), so an edit anywhere else never forces a recompile.
"""
