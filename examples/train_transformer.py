"""Train a small transformer sharded over a 2 x 2 ("dp", "tp") mesh, and check it against the
same training on one device.

The model is plain ``torch.nn`` code. ``fd.parallelize_module`` lays its parameters out by a
plan (Megatron-style tensor parallel over ``tp``, the batch over ``dp``; variants add sequence
parallelism, FSDP-style sharding over ``dp``, or context parallel attention), ``fd.Optimizer``
steps AdamW on the shards, and every step's loss is printed beside the single-device one.

    python examples/train_transformer.py                       # simulated mesh of 4 devices
    python examples/train_transformer.py --variant fsdp        # tp, sp, fsdp, sp+fsdp, cp
    torchrun --nproc-per-node 4 examples/train_transformer.py --backend distributed
    python examples/train_transformer.py --device cuda         # the simulated mesh on one GPU
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import optree
import rich
import torch
import torch.nn.functional as F
from torch import nn

import functional_dtensor as fd

R, S = fd.Replicate(), fd.Shard


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 8
    tied: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.output.weight = self.embed.weight
            nn.init.normal_(self.embed.weight, std=cfg.dim**-0.5)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


VARIANTS = ("tp", "sp", "fsdp", "sp+fsdp", "cp")


def axes_of(variant: str) -> tuple[str, str]:
    """The mesh's axis names: the batch over "dp", and "tp" (tensor parallel) or, for the
    context-parallel variant, "cp" (the sequence split, attention by ring)."""
    return ("dp", "cp") if variant == "cp" else ("dp", "tp")


def plan_for(variant: str) -> dict:
    """The plan of one variant: tensor parallel over "tp" (the batch over "dp" comes from the
    data), optionally with sequence parallelism and FSDP-style sharding over "dp"; context
    parallel: every parameter replicated, the sequence split over "cp" by the data."""
    if variant == "cp":
        return {"": fd.ReplicateParallel("dp")}  # replicated over dp too: one gradient all-reduce
    sp = "sp" in variant.split("+")
    seq = S(1) if sp else R
    plan = {
        "embed": fd.RowwiseParallel(output_layouts=seq),
        "layers.*.attn.wq": fd.ColwiseParallel(),
        "layers.*.attn.wk": fd.ColwiseParallel(),
        "layers.*.attn.wv": fd.ColwiseParallel(),
        "layers.*.attn.wo": fd.RowwiseParallel(output_layouts=seq),
        "layers.*.mlp.up": fd.ColwiseParallel(),
        "layers.*.mlp.down": fd.RowwiseParallel(output_layouts=seq),
        "output": fd.ColwiseParallel(),  # logits sharded over the vocabulary: loss parallel
    }
    if sp:
        plan |= {
            "layers.*.attn_norm": fd.SequenceParallel(),
            "layers.*.mlp_norm": fd.SequenceParallel(),
            "norm": fd.SequenceParallel(),
            # gather the sequence once per block, not once per projection
            "layers.*.attn": fd.PrepareModuleInput(desired_input_layouts=R),
            "layers.*.mlp": fd.PrepareModuleInput(desired_input_layouts=R),
        }
    if "fsdp" in variant.split("+"):
        plan |= {"layers.*": fd.FullyShard("dp"), "": fd.FullyShard("dp")}
    else:  # data parallel: the gradients summed over dp in one all-reduce per step
        plan |= {"": fd.ReplicateParallel("dp")}
    return plan


def batches(cfg: Config, steps: int, seed: int = 0):
    """Sequences counting up by a random stride (mod the vocabulary): learnable, so the loss
    falls. ``(tokens, targets)`` per step."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(cfg.vocab, (cfg.batch, 1), generator=g)
        stride = torch.randint(1, 4, (cfg.batch, 1), generator=g)
        seq = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
        yield seq[:, :-1], seq[:, 1:]


def loss_of(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def train_single(
    model: nn.Module, cfg: Config, steps: int, lr: float = 1e-2, device: str = "cpu"
) -> tuple[list[float], nn.Module]:
    """The reference: the same steps on one device (of type ``device``) with torch.optim.AdamW."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens, targets in batches(cfg, steps):
        loss = loss_of(model(tokens.to(device)), targets.to(device))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, model


def train_sharded(
    model: nn.Module, cfg: Config, mesh: fd.DeviceMesh, variant: str, steps: int, lr: float = 1e-2
):
    """The same training, sharded: ``(losses, params, comm)`` (the last step's communication)."""
    sharded = fd.parallelize_module(model, mesh, plan_for(variant))
    params = sharded.params
    opt = fd.Optimizer(torch.optim.AdamW, params, lr=lr)
    losses = []
    data = fd.P("dp", "cp") if variant == "cp" else fd.P("dp")
    for tokens, targets in batches(cfg, steps):
        with fd.CommDebugMode() as comm, fd.context_parallel("cp") if variant == "cp" else nullcontext():
            tokens_d = fd.distribute_tensor(tokens, mesh, data)
            targets_d = fd.distribute_tensor(targets, mesh, data)
            loss = loss_of(sharded.apply(params, tokens_d), targets_d)
            grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
            grads, _ = fd.clip_grad_norm(grads, 1.0)
            params = opt.step(params, grads)
        losses.append(loss.item())
    return losses, params, comm, opt


def bytes_per_device(tree) -> int:
    """Bytes of the shards the first device holds (this rank's, on the distributed backend)."""
    total = 0
    for leaf in optree.tree_leaves(tree, none_is_leaf=True):
        if isinstance(leaf, fd.DTensor):
            total += leaf.local_shards()[0].numel() * leaf.dtype.itemsize
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="tp", choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="simulated", choices=("simulated", "distributed"))
    parser.add_argument("--tied", action="store_true", help="tie the output layer to the embedding")
    parser.add_argument(
        "--device", default="cpu", help="the mesh's device type: cpu or cuda (NCCL when distributed)"
    )
    args = parser.parse_args(argv)
    cfg = Config(tied=args.tied)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if args.backend == "distributed":
        mesh = fd.init_device_mesh(args.device, (2, 2), axes_of(args.variant))
    else:
        mesh = fd.simulated_mesh((2, 2), axes_of(args.variant), device_type=args.device)
    talk = args.backend == "simulated" or int(os.environ.get("RANK", "0")) == 0
    reference, trained = train_single(model, cfg, args.steps, device=args.device)
    losses, params, comm, opt = train_sharded(model, cfg, mesh, args.variant, args.steps)
    if talk:
        print(f"{args.variant} on {mesh!r}")
        print(f"{'step':>4}  {'one device':>10}  {'sharded':>10}  {'difference':>10}")
        for step, (a, b) in enumerate(zip(reference, losses)):
            print(f"{step:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>10.2e}")
    worst = max(
        (params[name].full_tensor() - p.detach()).abs().max().item() for name, p in trained.named_parameters()
    )
    unsharded = sum(p.numel() * p.element_size() for p in trained.parameters())
    held = bytes_per_device(params)
    state = bytes_per_device(opt.state_dict()["state"])
    if talk:
        print(f"largest parameter difference after {args.steps} steps: {worst:.2e}")
        print(
            f"bytes per device: parameters {held} of {unsharded} ({held / unsharded:.2f}), "
            f"optimizer state {state} of {2 * unsharded} ({state / (2 * unsharded):.2f})"
        )
        print("communication of the last step:")
        rich.print(comm.table())
    if not math.isclose(reference[-1], losses[-1], rel_tol=1e-4, abs_tol=1e-5):
        raise SystemExit("the sharded training left the single-device one")


if __name__ == "__main__":
    main()
