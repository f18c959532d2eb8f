"""kvharbor inside vLLM: the KV connector, its plugin entry point and the version adapter.

Importing this package imports nothing from vLLM; `connector` does.
"""
