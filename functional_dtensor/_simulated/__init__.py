"""The simulated backend: every device of a mesh in this process, each value the stack of all
devices' shards (:mod:`.storage`), collectives as batched ops across the stack (:mod:`.kernels`),
per-device functions under one vmap over the devices (:mod:`.engine`, :mod:`.batching`), and
every call into functorch's internals (:mod:`.functorch`)."""
