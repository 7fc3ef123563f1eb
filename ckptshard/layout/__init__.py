"""Where every byte of a checkpoint lives: FSDP instances, flat parameters, chunk and box arithmetic. Pure: no I/O.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
