"""Transport-based cross-architecture fusion (merge operator ``transport``, task=transport)."""
