"""A simulated computational-storage card: a SimPy model behind the device protocol.

- `params`: every parameter of the model, its default and unit, in one place;
- `clock`: virtual time (as fast as possible) or scaled real time, over SimPy's core;
- `channels`: how long an operation takes on parallel flash channels;
- `card`: the card's state (keys, capacity, eviction, health, power, target) and
  its answers, as NVMe KV status codes;
- `device`: the HAL driver over it (`SimCardDevice`), with the fault-injection API.
"""
