"""Statistics and verdicts: intervals, the evidence rule (sessions or blocks, sufficiency), the
gate that compares a plan with its baseline, and the hypothesis tests of the proposal's
experiments.
"""
