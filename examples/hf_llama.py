"""Train transformers' ``LlamaForCausalLM``, as shipped, sharded by the plan it ships, beside the
same training on one device.

The model comes from a tiny config with random weights (nothing is downloaded).
``fd.parallelize_module(model, mesh, model._tp_plan)`` takes transformers' plan strings as they
are (q/k/v/gate/up ``"colwise"``, o/down ``"rowwise"``, the embedding ``"embedding_rowwise"``,
``lm_head`` ``"colwise_gather_output"``), ``fd.FullyShard("dp")`` shards each decoder layer over
the data axis, and ``fd.Optimizer`` steps AdamW on the shards. Every step's loss is printed beside
one device's.

    python examples/hf_llama.py                                   # simulated (2, 2) mesh
    torchrun --nproc-per-node 4 examples/hf_llama.py --backend distributed

(transformers is in the test extra: ``pip install -e '.[test]'``.)
"""

from __future__ import annotations

import argparse
import copy

import rich
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import functional_dtensor as fd


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["simulated", "distributed"], default="simulated")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    vocab, batch, seq = 256, 8, 32

    if args.backend == "simulated":
        mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    else:
        mesh = fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    model = tiny_llama(vocab)
    reference = copy.deepcopy(model)

    plan = {**model._tp_plan, "model.layers.*": fd.FullyShard("dp"), "": fd.FullyShard("dp")}
    sharded = fd.parallelize_module(model, mesh, plan)
    params = sharded.params
    opt = fd.Optimizer(torch.optim.AdamW, params, lr=3e-3)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)

    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        tokens = fd.distribute_tensor(ids, mesh, fd.P("dp"))
        loss = sharded.apply(params, input_ids=tokens, labels=tokens).loss
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        params = opt.step(params, grads)

        reference_opt.zero_grad()
        one = reference(input_ids=ids, labels=ids).loss
        one.backward()
        reference_opt.step()
        rich.print(f"step {step}: loss {loss.full_tensor().item():.6f}   one device {one.item():.6f}")


if __name__ == "__main__":
    main()
