"""Stand-ins for what SGLang imports but cannot have on a CPU machine (tests only).

Only the tests put this folder on ``sys.path`` (tests/sglang/conftest.py); kvharbor never
imports it. Each stand-in is the least that lets ``import sglang...`` succeed here:

- ``torchvision``: PyPI's torchvision is a CUDA build that fails to import beside the CPU
  torch (``operator torchvision::nms does not exist``), and SGLang's memory-pool modules
  import its vision configs at top level (``sglang.srt.configs`` ->
  ``multimodal.internvl_utils``). The stand-in offers the names those imports take;
  using any of them raises. The tests run a text model: nothing of it is used.
"""
