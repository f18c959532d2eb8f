"""Scenarios: outages replayed against the real gateway and connector, and fault campaigns.

- `marks`: a YAML loader that keeps each node's line, for errors naming FILE:LINE;
- `schema`: the scenario file (setup, timeline), validated whole before anything runs;
- `actions`: the one registry of timeline actions (name -> typed params and executor);
- `expectations`: what a timeline asserts, typed, and how each is judged;
- `drivers`: the engines a scenario runs (the lightweight connector driver, vLLM);
- `runner`: runs a scenario's steps and gives each its verdict (and a JSON result);
- `fuzz`: random timelines with invariants checked after every step, shrunk on failure.

Shipped scenarios live in ``kvharbor/scenarios/*.yaml`` (`catalog`).
"""
