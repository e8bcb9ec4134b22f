"""A model called inside `torch.func`'s transforms (`vmap`, `grad`, `jacrev`, `functional_call`), as per-sample-gradient
and Jacobian code does: results as bare, no warning, and the stats of the whole batch."""
import warnings
import pytest, torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torchember import torchEmber, load

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

def per_sample_grads(m, x, y):
    params = {k: v.detach() for k, v in m.named_parameters()}
    def loss(p, xi, yi): return ((functional_call(m, p, (xi[None],)) - yi[None]) ** 2).mean()
    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

CALLS = {
    'vmap(grad(functional_call))': per_sample_grads,
    'jacrev': lambda m, x, y: jacrev(m)(x[:3]),
    'vmap': lambda m, x, y: vmap(m)(x),
    'functional_call': lambda m, x, y: functional_call(m, {k: v * 2 for k, v in m.named_parameters()}, (x,)),
}

@pytest.mark.parametrize('name', list(CALLS))
def test_transforms_run_as_bare_without_warnings(db, name):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    m = model()
    bare = CALLS[name](m, x, y)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        with torchEmber(m, run='t', db=db):
            armed = CALLS[name](m, x, y)
            m(x).sum().backward()       # and an ordinary step after it
    assert not [str(w.message) for w in rec if 'torchember' in str(w.message)]
    for a, b in zip(torch.utils._pytree.tree_leaves(bare), torch.utils._pytree.tree_leaves(armed)): assert torch.equal(a, b)
    steps = load('t', db).steps()
    assert len(steps) == 2 and (steps['n_records'] > 0).all()

def test_vmap_stats_are_the_whole_batchs(db):
    m, x = model(), torch.randn(16, 4)
    with torchEmber(m, run='v', db=db): vmap(m)(x)
    row = load('v', db).df(step=0).query("module == '' and ttype == 'input'").iloc[0]
    assert row['numel'] == x.numel()
    assert row['mean'] == pytest.approx(x.double().mean().item(), rel=1e-9)
