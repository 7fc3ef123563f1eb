"""Execute plans into files: the copier and the torch.save, safetensors and DCP writers.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
