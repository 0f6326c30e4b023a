"""The physical harness: reads a container the way the runtime does on this machine's drives,
measures page-cache residency, calibrates a drive profile, and analyses measured STALL_TRACE runs.
"""
