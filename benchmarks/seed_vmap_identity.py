"""Are several seeds' LeNets, stacked (torch.func.stack_module_state) and vmapped, bit-identical to the unbatched
models at one thread? The precondition for batching the seeds of a grid cell into one computation without moving
trial ids or stored numbers.

    python benchmarks/seed_vmap_identity.py

Prints whether the forward outputs and parameter gradients of 4 LeNets (32 px, batch 1) agree bit for bit, and
the largest differences. Measured (torch 2.14.1, CPU, float32): not bit-identical, forward 3.8e-06, gradient
7.5e-07, so seed batching was not built.
"""
import copy
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
torch.set_num_threads(1)
from torch.func import functional_call, grad, stack_module_state, vmap

from gleak.mechanics.models import create_model

models = [create_model("lenet", (3, 32, 32), 10, seed=s) for s in range(4)]
params, buffers = stack_module_state(models)
base = copy.deepcopy(models[0]).to("meta")
x = torch.randn(4, 1, 3, 32, 32, generator=torch.Generator().manual_seed(0)); y = torch.tensor([1])
def loss(p, b, xi): return F.cross_entropy(functional_call(base, (p, b), (xi,)), y)
out_v = vmap(lambda p, b, xi: functional_call(base, (p, b), (xi,)))(params, buffers, x)
g_v = vmap(grad(loss))(params, buffers, x)
worst_out = worst_g = 0.0; ident = True
for i, m in enumerate(models):
    o = m(x[i]); g = torch.autograd.grad(F.cross_entropy(o, y), list(m.parameters()))
    worst_out = max(worst_out, (o - out_v[i]).abs().max().item())
    for (n, _), gi in zip(m.named_parameters(), g):
        d = (gi - g_v[n][i]).abs().max().item(); worst_g = max(worst_g, d); ident &= torch.equal(gi, g_v[n][i])
    ident &= torch.equal(o, out_v[i])
print(f"bit-identical: {ident}; max |forward diff| {worst_out:.3g}; max |grad diff| {worst_g:.3g}")
