"""The real colibrì engine: its run configuration (environment variables) mapped onto the
model's, its own ``PROFILE``/``PROF`` output read, and the metrics taken from its runs.
"""
