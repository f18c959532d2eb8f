"""The engines a scenario drives: `light` (the connector's code paths, synthetic KV)."""
