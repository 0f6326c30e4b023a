"""Planning: co-activation counts, Louvain clusters, expert orders, shard packing, vertical
splits and placement over drives, made into a plan; and the runtime a replay command asks for.
"""
