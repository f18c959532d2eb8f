"""Capacity planning: how large must the cache be for this traffic, and what does it buy?

- `workload`: requests (arrival, prompt length, output length, prefix-chained block
  ids), read from a Mooncake-format JSONL trace or made by generators;
- `cost`: model shapes (KV bytes per token, prefill FLOPs) and GPUs (prefill FLOP
  rate, host-to-device bandwidth), with the defaults and their sources;
- `caches`: block caches (policies ``lru`` and ``workload``) and the hit of a prompt;
- `stack`: LRU stack distances, which give every capacity's hit rate in one pass;
- `sweep`: one global cache per capacity, the hit-rate curve, the smallest size for a target;
- `fleet`: a SimPy run of N engines (GPU prefix cache, host RAM, card) with routing and
  the connector's load-or-recompute choice, one event per request and per transfer;
- `report`: the table, the JSON document, PNG plots and one self-contained HTML page.

`kvharbor plan` (`kvharbor.cli.plan`) puts them together. See docs/planner.md.
"""
