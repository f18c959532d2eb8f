"""kvharbor: a persistent, tiered KV cache for LLM serving engines."""

__version__ = "0.1.0"
