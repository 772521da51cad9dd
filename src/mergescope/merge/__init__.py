"""Merge operators, registered with ``@merges.register(name, needs_base=...)``; modules discovered."""
