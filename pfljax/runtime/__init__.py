"""How rounds run, apart from what they compute.

- `blocks`: blocks of rounds compiled as one program (a `lax.scan` over the round,
  evaluation on device where it falls);
- `replicas`: a replica axis over seeds and option grids (one vectorized program);
- `offload`: clients kept in host memory, a round's participants moved to the device;
- `memory`: device-memory estimates and reports;
- `sharding`: the client axis sharded over devices and processes (`jax.sharding`).

Imports go one way: runtime -> core, never core -> runtime; algorithms never need it.
"""
