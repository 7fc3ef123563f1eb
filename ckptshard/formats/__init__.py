"""Bytes <-> objects: zip records, torch.save pickles and layout, safetensors headers, DCP metadata.

Pure: no file descriptors, threads or torch.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
