"""verify-resume: a resumed multi-process run must match an uninterrupted one.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
