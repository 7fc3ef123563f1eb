"""The operating system: atomic outputs, watched inputs, file windows, hashing, zip CRCs, manifests, libc calls.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
