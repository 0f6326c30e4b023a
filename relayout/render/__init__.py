"""Rendering: every text table, summary and sentence the command line prints.
"""
