"""The commands: validate inputs and outputs, plan, write atomically with progress, across processes or torchrun ranks.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
