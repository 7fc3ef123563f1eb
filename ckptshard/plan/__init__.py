"""Copy plans: which source elements go where. Pure data, no I/O."""
from .intervals import Piece, pieces, reshard_pieces

__all__ = ["Piece", "pieces", "reshard_pieces"]
