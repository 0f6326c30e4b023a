"""Policy studies over the model: placement of pinned experts, split-size curves, and the
experiments that compare prefetch sources and admission policies.
"""
