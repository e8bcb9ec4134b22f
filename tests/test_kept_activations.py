"""The hooks keep small activations and hand them to the recorder at the forward's end (`core.Capture._keep`): a
module that changes a tensor in place after its hook must be caught at the first recorded step, even when that
tensor's Python object is gone by the forward's end (a residual `out += x` in a block), and never lose a row."""
import math, warnings
import torch
from torch import nn
from torchember import torchEmber

class Residual(nn.Module):
    "The layer's output is changed in place (`out += x`) and its Python object dies inside the block."
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=False)
    def forward(self, x):
        out = self.norm(self.lin(x))
        out += x
        return torch.relu(out) * 0.5

def test_in_place_change_after_the_hook_is_caught_at_the_first_step(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(Residual(), Residual(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)   # no "changed in place after its hook": no row left empty
        t = torchEmber(net, run='kept', db=str(tmp_path/'k.db'))
        for _ in range(4):
            net(torch.randn(16, 8)).sum().backward(); opt.step(); opt.zero_grad()
        t.flush()
    df = t.df()
    t.disarm()
    norm_out = df[(df.module == '0.norm') & (df.ttype == 'output')]
    assert len(norm_out) == 4 and norm_out['mean'].notna().all()
    assert (norm_out['mean'].abs() < 1e-5).all()          # LayerNorm's output as its hook saw it: mean 0, before `+= x`
    assert t.capture._eager[t.capture.names.index('0.norm')] is True
    assert t.capture._eager[t.capture.names.index('2')] is False   # the last layer's tensors are kept

def test_a_module_that_changes_in_place_only_sometimes_leaves_one_empty_row_and_says_so(tmp_path):
    class Sometimes(nn.Module):
        def __init__(self): super().__init__(); self.lin, self.n = nn.Linear(4, 4), 0
        def forward(self, x):
            self.n += 1
            y = self.lin(x)
            if self.n == 3: y.mul_(2)
            return y * 1
    net = Sometimes()
    t = torchEmber(net, run='sometimes', db=str(tmp_path/'s.db'))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(5): net(torch.randn(2, 4)).sum().backward()
        t.flush()
    said = [x for x in w if 'changed in place after its hook' in str(x.message)]
    df = t.df()
    t.disarm()
    lin = df[(df.module == 'lin') & (df.ttype == 'output')].set_index('step')
    assert len(said) == 1 and list(lin.index) == [0, 1, 2, 3, 4]
    assert math.isnan(lin.loc[2, 'mean']) and lin.drop(index=2)['mean'].notna().all()   # that step's row: its key, no stats
