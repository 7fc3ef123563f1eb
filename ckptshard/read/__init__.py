"""Find, open and check checkpoints: shard discovery, containers, lazy torch.save and safetensors reading, DCP folders.

Internal: not part of the public API, which ckptshard/__init__.py declares.
"""
