"""The demo behind ``python -m functional_dtensor``: layouts on an 8-device simulated mesh."""

from __future__ import annotations

import torch

import functional_dtensor as fd


def main() -> None:
    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    print(mesh)
    print(repr(mesh))
    x = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    for spec in (fd.P("dp", "tp"), fd.P(("dp", "tp")), fd.P(None, "tp"), fd.P()):
        layout = fd.Layout.from_spec(mesh, spec)
        value = fd.distribute_tensor(x, mesh, spec)
        shapes = [tuple(s.shape) for s in value.local_shards()]
        same = torch.equal(value.full_tensor(), x)
        print(f"{str(spec):<18} {str(layout):<10} local shapes {shapes}  round trip: {same}")


if __name__ == "__main__":
    main()
