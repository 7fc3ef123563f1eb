"""What a checkpoint is: every family probed in one place (``probe.open_source``), each opened into a
``Source`` (``base``) that every command works from; one module per family.

Internal: not part of the public API, which ckptshard/__init__.py declares (``ckptshard.open_source``).
"""
