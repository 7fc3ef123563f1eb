"""Real fairscale checkpoints for tests, the demo and benchmarks.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
