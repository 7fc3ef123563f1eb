"""Live fairscale FSDP models: loading checkpoints, the head-wrapping flow, the CPU compatibility layer.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
