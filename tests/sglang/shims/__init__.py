"""What SGLang 0.5.23 lacks to run on a CPU machine, for the tests only (kvharbor never imports it).

`install.install` puts one import hook in front of Python's own: it serves the stand-in
modules of ``modules/`` and patches a few SGLang modules right after they are imported.
``boot/sitecustomize.py`` installs the same hook in every process of an engine the tests
start (SGLang spawns its scheduler), when ``boot`` is on ``PYTHONPATH``.

Stand-ins (importable; using any of their names raises, naming it):

- ``torchvision``: PyPI's torchvision is a CUDA build that fails to import beside the CPU
  torch (``operator torchvision::nms does not exist``), and SGLang's memory-pool modules
  import its vision configs at top level (``sglang.srt.configs`` ->
  ``multimodal.internvl_utils``). transformers is asked first whether torchvision is
  installed (the answer, "no", is cached), so it never imports the stand-in's video helpers;
- ``sgl_kernel``: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports CPU kernels from
  it at top level (``copy_all_layer_kv_cache_cpu`` in ``kernels/ops/kvcache/cache_move``);
  its CPU build is not on PyPI. With AMX reported absent (below) a Llama runs on SGLang's
  pure-torch paths and calls none of them.

Patches (`PATCHES`), each the least that lets the engine with HiCache start and move pages:

- ``cpu_has_amx_support`` says no: on a CPU with AMX SGLang would call ``sgl_kernel`` CPU ops
  (rmsnorm, rope, ...); without it the same model runs on torch's own ops, on every machine;
- ``_cuda_host_register`` does nothing, and host KV pools are not pinned: SGLang registers
  the host pool with CUDA (``cudaHostRegister``), which CPU torch cannot;
- ``transfer_kv_direct`` (``--hicache-io-backend direct``) is a torch index copy per layer:
  SGLang binds it from ``sgl_kernel.kvcacheio`` on CUDA and ROCm only.

The engine test passes ``--hicache-io-backend direct --hicache-mem-layout layer_first``, the
one page path these patches cover.
"""
