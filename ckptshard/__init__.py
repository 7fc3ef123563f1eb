"""ckptshard: consolidate and reshard fairscale FSDP checkpoints."""
__version__ = "0.1.0"
