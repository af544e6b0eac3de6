"""Calling ``torch.autograd.Function`` s cheaply.

``Function.apply`` binds the arguments to ``forward``'s signature on every call when the function
defines ``setup_context`` (to fill in default arguments, which ours never have): about 20 us a
call, more than the ops of a small collective. When no ``torch.func`` transform is active and
nothing is being compiled, the base ``apply`` does the same work without it.
"""

from __future__ import annotations

import torch

__all__ = ["apply"]


def apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, skipping the signature binding where it is not needed."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)
