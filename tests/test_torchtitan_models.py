"""torchtitan's Llama 3, as shipped (its debug model's config scaled down, random init, nothing
downloaded), trained sharded on a ("dp", "tp") mesh of 2 x 2 by a few AdamW steps under
torchtitan's own parallelisms translated into fd's styles: tensor parallel, tensor + sequence
parallel, FSDP and both. Every step's loss equals one device's, and so do the gradients, compared
at the same parameters (a constant factor on every gradient would hide behind AdamW).

The model is torchtitan's ``Llama3Model`` built from ``_build_llama3_layers`` (as the
``debugmodel`` flavor is: fused ``wqkv``, complex RoPE with llama scaling, SwiGLU), with one
change: the inner attention is torchtitan's ``ScaledDotProductAttention`` (causal) instead of
``FlexAttention``, whose backward torch does not implement on CPU (one device cannot train it
either). On unpacked sequences the two compute the same causal attention. The loss is
torchtitan's ``cross_entropy_loss`` (a sum, divided by the token count as its trainer does), on
the logits sharded over the vocabulary (torchtitan's loss parallel).

The model computes in float64 but its RoPE runs in complex64 (``query.float()``) and its loss
upcasts the logits to float32, so results are compared within float32's tolerance.
"""

from __future__ import annotations

import pytest
import torch

import functional_dtensor as fd

torchtitan = pytest.importorskip("torchtitan")
from common import assert_close, train_sharded  # noqa: E402

# torchtitan's model code, imported plainly: where torchtitan is installed but cannot import
# (its models import triton), the test fails rather than skips
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.models.common import (  # noqa: E402
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import (  # noqa: E402
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    _build_llama3_layers,
    _output_linear_init,
)

R, S = fd.Replicate(), fd.Shard
VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 128, 32, 4, 2, 2
BATCH, SEQ, STEPS = 4, 16, 3


def llama3(fuse_qkv: bool = True) -> Llama3Model:
    """torchtitan's ``debugmodel`` config (llama3/__init__.py), scaled down, in float64."""
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=fuse_qkv,
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:  # flex attention has no backward on CPU (see the docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.double()


def tensor_parallel(sequence_parallel: bool = False, fuse_qkv: bool = True) -> dict:
    """torchtitan's tensor-parallel plan for Llama 3 (``set_llama3_sharding_config``) in fd's
    styles: the embedding row-parallel (vocabulary rows), q/k/v and w1/w3 column-parallel, wo and
    w2 row-parallel, the output column-parallel with its logits left sharded over the vocabulary
    for the loss. Under sequence parallel the blocks' outputs are reduce-scattered to the
    sequence, the norms run on sequence shards, attention and feed-forward gather their input, and
    the final norm gathers its output for the output layer."""
    between = S(1) if sequence_parallel else R
    qkv = "layers.*.attention.qkv_linear." + ("wqkv" if fuse_qkv else "w[qkv]")
    plan = {
        "tok_embeddings": fd.RowwiseParallel(input_layouts=R, output_layouts=between),
        qkv: fd.ColwiseParallel(),
        "layers.*.attention.wo": fd.RowwiseParallel(output_layouts=between),
        "layers.*.feed_forward.w1": fd.ColwiseParallel(),
        "layers.*.feed_forward.w3": fd.ColwiseParallel(),
        "layers.*.feed_forward.w2": fd.RowwiseParallel(output_layouts=between),
        "lm_head": fd.ColwiseParallel(input_layouts=R, output_layouts=S(-1)),
    }
    if sequence_parallel:
        plan |= {
            "layers.*.attention_norm": fd.SequenceParallel(),
            "layers.*.ffn_norm": fd.SequenceParallel(),
            # forward(x_BLD, attention_masks, positions): only x is laid out
            "layers.*.attention": fd.PrepareModuleInput(
                input_layouts=(S(1), None, None), desired_input_layouts=(R, None, None)
            ),
            "layers.*.feed_forward": fd.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R,)),
            "norm": (
                fd.SequenceParallel(),
                fd.PrepareModuleOutput(output_layouts=S(1), desired_output_layouts=R),
            ),
        }
    return plan


#: torchtitan's FSDP units (``apply_fsdp_to_decoder``): the embedding, each block, [norm, output]
#: as one unit (a tuple of names), and the root.
FSDP = {
    "tok_embeddings": fd.FullyShard("dp"),
    "layers.*": fd.FullyShard("dp"),
    ("norm", "lm_head"): fd.FullyShard("dp"),
    "": fd.FullyShard("dp"),
}


def together(*plans: dict) -> dict:
    """Plans merged, a module named by several getting all their styles in order (as torchtitan
    applies tensor parallel before ``fully_shard``)."""
    merged: dict = {}
    for plan in plans:
        for name, style in plan.items():
            merged[name] = (*_as_tuple(merged[name]), style) if name in merged else style
    return merged


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def plan_of(variant: str, fuse_qkv: bool = True) -> dict:
    tp = tensor_parallel(fuse_qkv=fuse_qkv)
    sp = tensor_parallel(sequence_parallel=True, fuse_qkv=fuse_qkv)
    return {
        "tp": tp,
        "tp+sp": sp,
        "fsdp": FSDP,
        "tp+fsdp": together(tp, FSDP),
        "tp+sp+fsdp": together(sp, FSDP),
    }[variant]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and labels as torchtitan's dataloader makes them: a sequence and its shift."""
    generator = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_of(logits, labels):
    """torchtitan's loss: ``cross_entropy_loss`` sums, the trainer divides by the token count."""
    return cross_entropy_loss(logits, labels) / labels.numel()


def job_train(mesh, variant: str, fuse_qkv: bool):
    """``STEPS`` AdamW steps of the sharded model: per step its loss and its gradients, with the
    parameters they were taken at (global values)."""
    sharded = fd.parallelize_module(llama3(fuse_qkv), mesh, plan_of(variant, fuse_qkv))
    batches = [[fd.distribute_tensor(t, mesh, fd.P("dp")) for t in batch] for batch in _batches()]
    return train_sharded(
        sharded.params, batches, lambda params, b: loss_of(sharded.apply(params, b[0]), b[1])
    )


def one_device(fuse_qkv: bool) -> list[torch.Tensor]:
    """One device's losses over the same AdamW steps."""
    model = llama3(fuse_qkv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, labels in _batches():
        opt.zero_grad()
        loss = loss_of(model(ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def gradients_at(fuse_qkv: bool, params: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """One device's gradients at ``params`` (copied in by parameter name: the fused ``wqkv``'s
    state-dict hooks would split and re-merge it)."""
    model = llama3(fuse_qkv)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in params.items():
            named[name].copy_(value)
    loss = loss_of(model(ids), labels)
    return dict(zip(params, torch.autograd.grad(loss, [named[n] for n in params])))


CASES = [
    ("tp", True),
    ("tp+sp", True),
    ("fsdp", True),
    ("tp+fsdp", True),
    ("tp+sp+fsdp", True),
    ("tp+sp", False),  # separate wq/wk/wv (fuse_qkv=False)
]
IDS = [v if fused else f"{v}-unfused-qkv" for v, fused in CASES]


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize(("variant", "fuse_qkv"), CASES, ids=IDS)
def test_torchtitan_llama3_trains_sharded_as_on_one_device(backend, mesh, variant, fuse_qkv):
    if not backend.is_simulated and (variant, fuse_qkv) != ("tp+sp+fsdp", True):
        pytest.skip("the gloo ranks run one plan in the default tier (all in test_..._long)")
    check_training(backend, variant, fuse_qkv)


@pytest.mark.slow
@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize(("variant", "fuse_qkv"), CASES, ids=IDS)
def test_torchtitan_llama3_trains_sharded_as_on_one_device_long(backend, mesh, variant, fuse_qkv):
    check_training(backend, variant, fuse_qkv)


def check_training(backend, variant: str, fuse_qkv: bool) -> None:
    losses = one_device(fuse_qkv)
    batches = _batches()
    for steps in backend.run(job_train, (2, 2), ("dp", "tp"), variant, fuse_qkv, timeout=240):
        for k, (step, want_loss, (ids, labels)) in enumerate(zip(steps, losses, batches)):
            assert_close(step["loss"], want_loss, dtypes=(torch.float32,), msg=f"loss at step {k}")
            want = gradients_at(fuse_qkv, step["params"], ids, labels)
            assert want.keys() == step["grads"].keys()
            for param, grad in want.items():
                # at unit scale: the gradients are of 1e-5 to 1e-2, where float32's absolute
                # tolerance (1e-5, for values of unit scale) would pass nearly anything
                scale = grad.abs().max().clamp_min(torch.finfo(grad.dtype).tiny)
                assert_close(
                    step["grads"][param] / scale,
                    grad / scale,
                    dtypes=(torch.float32,),
                    msg=lambda m, p=param, k=k: f"gradient of {p} at step {k} (over its largest): {m}",
                )


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_the_plan_shards_each_weight_as_torchtitan_declares(sequence_parallel):
    """fd's plan lays each parameter out on ``tp`` as torchtitan's own sharding configs
    (``set_llama3_sharding_config``) declare it: ``S(d)`` is dim ``d`` split over ``tp``,
    ``R`` and ``I`` leave it whole."""
    from torchtitan.distributed.parallel_dims import MeshAxisName
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    model = llama3()
    config = model.config
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    declared = {}  # parameter -> the dim torchtitan splits over tp (None: not split)
    for name, module in config.build().named_modules():
        sharding = getattr(module, "_sharding_config", None)
        for param, layout in (sharding.state_shardings if sharding else {}).items():
            tp = layout.per_axis_spmd_types().get(MeshAxisName.TP)
            declared[f"{name}.{param}"] = getattr(tp, "dim", None)  # S(d): d; R, I: None

    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    sharded = fd.parallelize_module(model, mesh, tensor_parallel(sequence_parallel))
    got, want = {}, {}
    for name, p in sharded.params.items():
        assert name in declared, f"torchtitan declares no layout for {name}"
        got[name] = next((d for d, entry in enumerate(p.spec) if "tp" in _as_tuple(entry)), None)
        want[name] = None if declared[name] is None else declared[name] % p.ndim
    assert got == want
