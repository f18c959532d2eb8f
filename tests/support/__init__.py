"""Test helpers (tiny model builder, etc.)."""
