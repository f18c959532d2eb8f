"""The real NVMe driver: a KV namespace through the kernel's passthrough, health through nvme-cli.

- `passthru`: the kernel's ``struct nvme_passthru_cmd64`` and the one function that
  issues ``NVME_IOCTL_IO64_CMD`` (injectable, so the code above it runs in tests);
- `kv_commands`: the NVMe Key Value command set's commands, encoded into that struct,
  and the data structures they return (Identify, List);
- `kv_device`: `NvmeKvDevice`, the device protocol over a ``/dev/ngXnY`` KV namespace;
- `cli`: running ``nvme ... -o json`` bounded by a timeout, with errors that name the
  device and the command;
- `health`: typed admin and health results parsed from every release's JSON shape.
"""
