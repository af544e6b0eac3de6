"""The distributed backend: one process per device over ``torch.distributed`` (gloo on CPU,
NCCL on CUDA): process groups and this rank's place in a mesh (:mod:`.runtime`), storage as
this rank's shard (:mod:`.storage`), collectives as c10d calls (:mod:`.kernels`), failures
translated (:mod:`.errors`), ranks that call different collectives found (:mod:`.checks`, a
debug mode), per-device functions run as they are (:mod:`.engine`)."""
