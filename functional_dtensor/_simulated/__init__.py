"""The simulated backend: every device of a mesh in this process, each value the stack of all
devices' shards (:mod:`.storage`), collectives as batched ops across the stack (:mod:`.kernels`),
per-device functions under one vmap over the devices (:mod:`.engine`, :mod:`.batching`), and
global ops' local forms on every device's block at once (:mod:`.batched`). Its calls into
functorch's internals go through :mod:`.._functorch`."""
