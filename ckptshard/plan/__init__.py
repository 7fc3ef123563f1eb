"""Copy plans from one layout to another (consolidate, reshard, shard, DCP): which source elements go where. Pure data.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
