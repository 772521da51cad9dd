"""mergescope: can these models be merged, by which route, and what does each diagnostic measure."""

__version__ = "0.1.0"
