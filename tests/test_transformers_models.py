"""transformers' Llama and GPT-2, as shipped (tiny configs, random init, no download), trained
sharded on a ("dp", "tp") mesh of 2 x 2 by a few AdamW steps under tensor parallel (Llama by the
plan it ships, ``model._tp_plan``, as it is), sequence parallel, FSDP and both: every step's loss
equals one device's, and so do the gradients, compared at the same parameters (a constant factor
on every gradient would hide behind AdamW).

The models compute in float64; transformers' loss upcasts logits to float32, so results are
compared within float32's tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch

import functional_dtensor as fd

transformers = pytest.importorskip("transformers")
from backends import Backend  # noqa: E402
from common import assert_close, held_at_any_size, train_sharded  # noqa: E402

R, S = fd.Replicate(), fd.Shard
VOCAB, BATCH, SEQ, STEPS = 128, 4, 16, 3


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).double()


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_pdrop=0.0,  # dropout would draw from torch's global generator (see fd.random)
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).double()


MODELS = {"llama": llama, "gpt2": gpt2}

FSDP = {"": fd.FullyShard("dp")}


def _llama_sequence_parallel() -> dict:
    """Megatron's sequence parallel on Llama's modules: the norms on sequence shards, the
    attention and MLP inputs gathered (attention takes its input by keyword), their outputs
    reduce-scattered back to the sequence, the loss on gathered logits."""
    return {
        "model.embed_tokens": fd.RowwiseParallel(output_layouts=S(1)),
        "model.layers.*.input_layernorm": fd.SequenceParallel(),
        "model.layers.*.post_attention_layernorm": fd.SequenceParallel(),
        "model.layers.*.self_attn": fd.PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": S(1)}, desired_input_kwarg_layouts={"hidden_states": R}
        ),
        "model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": fd.RowwiseParallel(output_layouts=S(1)),
        "model.layers.*.mlp": fd.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R,)),
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": fd.RowwiseParallel(output_layouts=S(1)),
        "model.norm": fd.SequenceParallel(),
        "lm_head": fd.ColwiseParallel(input_layouts=S(1), output_layouts=R),
    }


#: GPT-2 ships no plan: its Conv1D layers by fd's styles (weights stored transposed)
GPT2_TP = {
    "transformer.wte": "embedding_rowwise",
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}


def plan_of(name: str, variant: str, model) -> dict:
    tp = dict(model._tp_plan) if name == "llama" else GPT2_TP
    fsdp = {"model.layers.*" if name == "llama" else "transformer.h.*": fd.FullyShard("dp"), **FSDP}
    return {
        "tp": tp,
        "tp+sp": _llama_sequence_parallel() if name == "llama" else None,
        "fsdp": fsdp,
        "tp+fsdp": {**tp, **fsdp},
    }[variant]


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def job_train(mesh, name: str, variant: str, compiled: bool = False):
    """``STEPS`` AdamW steps of the sharded model: per step its loss and its gradients, with the
    parameters they were taken at (global values). ``compiled``: the loss by
    ``torch.compile(fullgraph=True)`` of ``apply``."""
    model = MODELS[name]()
    sharded = fd.parallelize_module(model, mesh, plan_of(name, variant, model))

    def loss_of(params, x):
        return sharded.apply(params, input_ids=x, labels=x).loss

    if compiled:
        torch._dynamo.reset()
        loss_of = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    batches = [fd.distribute_tensor(ids, mesh, fd.P("dp")) for ids in _batches()]
    return train_sharded(sharded.params, batches, loss_of)


def one_device(name: str) -> list[float]:
    """One device's losses over the same AdamW steps."""
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in _batches():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def gradients_at(name: str, params: dict, ids: torch.Tensor) -> dict:
    """One device's gradients at ``params``."""
    model = MODELS[name]()
    model.load_state_dict({**model.state_dict(), **params})
    named = dict(model.named_parameters())
    loss = model(input_ids=ids, labels=ids).loss
    return dict(zip(params, torch.autograd.grad(loss, [named[n] for n in params])))


CASES = [
    ("llama", "tp"),
    ("llama", "tp+sp"),
    ("llama", "fsdp"),
    ("llama", "tp+fsdp"),
    ("gpt2", "tp"),
    ("gpt2", "fsdp"),
    ("gpt2", "tp+fsdp"),
]


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize(("name", "variant"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_a_transformers_model_trains_sharded_as_on_one_device(backend, mesh, name, variant):
    if not backend.is_simulated and (name, variant) not in [("llama", "tp+fsdp"), ("gpt2", "tp")]:
        pytest.skip("the gloo ranks run one plan per model in the default tier (all in test_..._long)")
    check_training(backend, name, variant)


@pytest.mark.parametrize(("name", "variant"), [("llama", "tp+fsdp"), ("llama", "tp+sp"), ("gpt2", "tp")])
def test_a_transformers_model_trains_with_replicated_values_held_once(name, variant):
    """The simulated mesh holding every value replicated over an axis once (the tiny configs'
    values are below the size it holds by default): losses and gradients as one device's."""
    with held_at_any_size():
        check_training(Backend("simulated"), name, variant)


@pytest.mark.slow
@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize(("name", "variant"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_a_transformers_model_trains_sharded_as_on_one_device_long(backend, mesh, name, variant):
    check_training(backend, name, variant)


@pytest.mark.slow
@pytest.mark.meshes((2, 2))
def test_llama_compiled_trains_sharded_as_on_one_device_long(backend, mesh):
    """``torch.compile(fullgraph=True)`` of the sharded forward and loss of Llama as shipped
    (tensor parallel by its plan and FSDP)."""
    check_training(backend, "llama", "tp+fsdp", compiled=True)


def check_training(backend, name: str, variant: str, compiled: bool = False) -> None:
    losses = one_device(name)
    batches = _batches()
    timeout = 900 if compiled else 240
    for steps in backend.run(job_train, (2, 2), ("dp", "tp"), name, variant, compiled, timeout=timeout):
        for k, (step, want_loss, ids) in enumerate(zip(steps, losses, batches)):
            assert_close(step["loss"], want_loss, dtypes=(torch.float32,), msg=f"loss at step {k}")
            want = gradients_at(name, step["params"], ids)
            for param, grad in want.items():
                assert_close(
                    step["grads"][param],
                    grad,
                    dtypes=(torch.float32,),
                    msg=lambda m, p=param, k=k: f"gradient of {p} at step {k}: {m}",
                )


def test_the_plan_transformers_ships_is_taken_as_it_is():
    model = llama()
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    sharded = fd.parallelize_module(copy.deepcopy(model), mesh, model._tp_plan)
    specs = {n: p.spec for n, p in sharded.params.items()}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == fd.P("tp")
    assert specs["model.layers.0.self_attn.o_proj.weight"] == fd.P(None, "tp")
    assert specs["model.embed_tokens.weight"] == fd.P("tp")
    assert specs["lm_head.weight"] == fd.P("tp")


def test_the_example_trains_llama_beside_one_device(capsys, monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--steps", "2"])
    runpy.run_path(str(example), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(lines) == 2
    for line in lines:  # (printed to 6 decimals: far inside float32's tolerance at this scale)
        sharded, one = (torch.tensor(float(line.split()[k]), dtype=torch.float64) for k in (3, -1))
        assert_close(sharded, one, dtypes=(torch.float32,), msg=line)
