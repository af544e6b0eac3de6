"""A training step of transformers' ``LlamaForCausalLM``, as shipped, sharded by the plan it
ships (tensor parallel over ``tp``, each decoder layer and the root FSDP over ``dp``).

    python bench/hf_llama.py [--quick]                                  # simulated (2, 2) mesh
    torchrun --standalone --nproc-per-node 4 bench/hf_llama.py [--quick]   # 4 gloo ranks

A step is forward with labels (transformers' loss), backward and AdamW. Variants, interleaved
in one loop, medians of CPU time (one thread per process):

* simulated: ``fd`` on a simulated ("dp", "tp") mesh of 2 x 2 beside ``one device`` (plain
  torch on the whole batch): the simulation's cost over the program itself;
* gloo ranks: ``fd`` on ``fd.init_device_mesh("cpu", (2, 2))`` beside ``torch DTensor``: the
  same model parallelized by torch (``parallelize_module`` with the torch styles transformers'
  strings name, then ``fully_shard`` of each decoder layer and the root over ``dp``, FSDP2),
  with a barrier before each sample; rank 0's medians (wall and CPU).

Both variants are checked against one device's first-step loss before timing.
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings

import torch
import torch.distributed as dist
from _timing import interleaved, median_ms, print_table, verdict
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import functional_dtensor as fd

SIM_TARGET, GLOO_TARGET = 1.3, 0.85  # fd / one device (simulated), fd / torch DTensor (gloo)


def model_of(quick: bool) -> tuple[LlamaForCausalLM, int]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512 if quick else 2048,
        hidden_size=64 if quick else 256,
        intermediate_size=128 if quick else 1024,
        num_hidden_layers=2,
        num_attention_heads=4 if quick else 8,
        num_key_value_heads=2 if quick else 4,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config), config.vocab_size


def batch_of(vocab: int, quick: bool) -> torch.Tensor:
    batch, seq = (4, 32) if quick else (8, 128)
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def fd_step(model, mesh, ids):
    plan = {**model._tp_plan, "model.layers.*": fd.FullyShard("dp"), "": fd.FullyShard("dp")}
    sharded = fd.parallelize_module(model, mesh, plan)
    state = {"params": sharded.params}
    opt = fd.Optimizer(torch.optim.AdamW, state["params"], lr=1e-4)
    tokens = fd.distribute_tensor(ids, mesh, fd.P("dp"))

    def step():
        params = state["params"]
        loss = sharded.apply(params, input_ids=tokens, labels=tokens).loss
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        state["params"] = opt.step(params, grads)
        return loss

    return step


def plain_step(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    return step


def torch_dtensor_step(model, ids):
    """torch's own: the styles transformers' strings name, then FSDP2 over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], {k: styles[v] for k, v in model._tp_plan.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    rank = mesh["dp"].get_local_rank()
    local = ids.chunk(2)[rank]
    return plain_step(model, local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    reps = args.reps or (3 if args.quick else 7)
    model, vocab = model_of(args.quick)
    ids = batch_of(vocab, args.quick)
    want = copy.deepcopy(model)(input_ids=ids, labels=ids).loss.item()

    if "WORLD_SIZE" not in os.environ:
        steps = {
            "one device (plain torch)": plain_step(copy.deepcopy(model), ids),
            "fd, simulated 2x2": fd_step(copy.deepcopy(model), fd.simulated_mesh((2, 2), ("dp", "tp")), ids),
        }
        for name, step in steps.items():
            got = step()
            got = got.full_tensor().item() if isinstance(got, fd.DTensor) else got.item()
            assert abs(got - want) < 1e-4 * abs(want), f"{name}: first loss {got}, one device {want}"
        times = interleaved(steps, reps=reps, warmup=1)
        base = median_ms(times["one device (plain torch)"].cpu)
        rows = []
        for name, samples in times.items():
            ratio = median_ms(samples.cpu) / base
            target = verdict(ratio, SIM_TARGET) if name.startswith("fd") else ""
            rows.append([name, f"{median_ms(samples.cpu):.1f}", f"{ratio:.2f}", target])
        print_table(
            f"transformers Llama training step (batch {tuple(ids.shape)}): medians of {reps}, 1 thread",
            ["variant", "cpu ms", "/ one device", "target"],
            rows,
        )
        return

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    steps = {
        "torch DTensor (TP + FSDP2)": torch_dtensor_step(copy.deepcopy(model), ids),
        "fd": fd_step(copy.deepcopy(model), mesh, ids),
    }
    fd_loss = steps["fd"]().full_tensor().item()
    assert abs(fd_loss - want) < 1e-4 * abs(want), f"fd: first loss {fd_loss}, one device {want}"
    steps["torch DTensor (TP + FSDP2)"]()
    times = interleaved(steps, reps=reps, warmup=1, before_each=dist.barrier)
    if rank == 0:
        base = times["torch DTensor (TP + FSDP2)"]
        rows = []
        for name, samples in times.items():
            wall = median_ms(samples.wall) / median_ms(base.wall)
            cpu = median_ms(samples.cpu) / median_ms(base.cpu)
            target = verdict(wall, GLOO_TARGET) if name == "fd" else ""
            rows.append([name, f"{median_ms(samples.wall):.1f}", f"{wall:.2f}", f"{cpu:.2f}", target])
        print_table(
            f"transformers Llama training step on 4 gloo ranks, (dp 2, tp 2), batch {tuple(ids.shape)}: "
            f"rank 0's medians of {reps}",
            ["variant", "wall ms", "/ DTensor (wall)", "/ DTensor (cpu)", "target"],
            rows,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
