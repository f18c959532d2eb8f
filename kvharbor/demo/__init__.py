"""``kvharbor demo``: a restart hit on a real vLLM, end to end, with a model built locally.

`model` builds the tiny random-weight model (no model hub needed); `run` drives
the demo. Importing this package imports neither vLLM nor torch.
"""
