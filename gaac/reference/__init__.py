"""The slow, readable NumPy reference codec: the oracle every fast path is tested against."""
