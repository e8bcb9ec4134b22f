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

class Mixed(nn.Module):
    "Outputs of every sort the batched read must sort out: a permuted view, float64, ints, an Inf, a dict, a repeat."
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
    def forward(self, x):
        y = self.lin(x)
        big = y.detach().double() * 1e3
        big[0, 0] = float('inf')
        return {'t': y.t(), 'big': big, 'ids': torch.arange(5), 'same': y, 'y': y * 2}

def test_kept_activations_read_together_give_the_stats_read_one_by_one(tmp_path, monkeypatch):
    def run(keep):
        monkeypatch.setenv('TORCHEMBER_KEEP', keep)
        torch.manual_seed(0)
        net = nn.Sequential(Mixed())
        t = torchEmber(net, run=f'keep{keep}', db=str(tmp_path/f'k{keep}.db'))
        for _ in range(4): sum(v.float().sum() for v in net(torch.randn(3, 6)).values() if v.requires_grad).backward()
        t.flush()
        df = t.df()
        kept = t.capture._eager.get(t.capture.names.index('0'))
        t.disarm()
        cols = ['step', 'module', 'ttype', 'tname', 'shape', 'dtype', 'numel', 'mean', 'std', 'min', 'max', 'norm', 'zero_frac', 'nan_count', 'inf_count']
        return df[df.ttype.isin(['input', 'output'])][[c for c in cols if c in df]].sort_values(['step', 'module', 'ttype', 'tname']).reset_index(drop=True), kept
    together, kept = run('1')
    one_by_one, _ = run('0')
    assert kept is False                           # the module's tensors were kept, and read in one call from step 1 on
    assert len(together) == 4 * 14              # a step: the root's, the Sequential's and Mixed's input and 5 outputs, the Linear's 2
    assert together[together.tname == 'output.big']['inf_count'].eq(1).all() and together['mean'].notna().sum() >= 4 * 12
    import pandas as pd
    pd.testing.assert_frame_equal(together, one_by_one)

def _meta_run(tmp_path, monkeypatch, keep, name):
    "Three steps of a model on the meta device (an accelerator's stand-in: not the CPU) with 2 MiB activations."
    monkeypatch.setenv('TORCHEMBER_KEEP', keep)
    net = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.Linear(1024, 8)).to('meta')
    t = torchEmber(net, run=name, db=str(tmp_path/f'{name}.db'))
    handed, tensors = [], t.capture.recorder.tensors
    t.capture.recorder.tensors = lambda items: handed.append([it[4].nbytes for it in items]) or tensors(items)
    for _ in range(3): net(torch.randn(512, 1024, device='meta')).sum().backward()
    t.flush()
    df = t.df()
    eager = dict(t.capture._eager)
    t.disarm()
    cols = ['step', 'module', 'ttype', 'tname', 'call', 'shape', 'dtype', 'numel']
    return df[cols].sort_values(cols[:5]).reset_index(drop=True), handed, eager

def test_an_accelerators_activations_are_kept_whatever_their_size(tmp_path, monkeypatch):
    "Off the CPU, activations over `KEEP_BYTES` are kept too and handed over together, with the keys read at hooks give."
    import pandas as pd
    from torchember import core
    kept, handed, eager = _meta_run(tmp_path, monkeypatch, '1', 'kept')
    at_hooks, none, _ = _meta_run(tmp_path, monkeypatch, '0', 'hooks')
    assert set(eager.values()) == {False} and none == []
    assert len(handed) == 2 and max(handed[0]) > core.KEEP_BYTES      # steps 1 and 2, 2 MiB tensors among them
    pd.testing.assert_frame_equal(kept, at_hooks)

def test_an_accelerators_kept_activations_are_handed_over_within_the_held_bytes(tmp_path, monkeypatch):
    "No more than `held_cap` bytes of an accelerator's activations wait: past it, those kept are handed over."
    from torchember import core
    monkeypatch.setattr(core, 'WATCH_BYTES', 1)
    monkeypatch.setattr(core, 'HELD_BYTES', 5 * 2**20)
    monkeypatch.setattr(core, '_CAPS', {})
    _, handed, eager = _meta_run(tmp_path, monkeypatch, '1', 'capped')
    assert set(eager.values()) == {False}
    assert handed and all(sum(h[:-1]) <= 5 * 2**20 for h in handed) and max(len(h) for h in handed) >= 2

def test_an_accelerators_tensor_larger_than_the_room_is_read_at_its_hook(tmp_path, monkeypatch):
    "A tensor larger than what is left of `held_cap` is never watched (held to the forward's end): its module stays measured at its hooks."
    from torchember import core
    monkeypatch.setattr(core, 'WATCH_BYTES', 1)
    monkeypatch.setattr(core, 'HELD_BYTES', 5 * 2**20)
    monkeypatch.setattr(core, '_CAPS', {})
    monkeypatch.setenv('TORCHEMBER_KEEP', '1')
    net = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 8)).to('meta')   # 8 MiB in and out of the first
    t = torchEmber(net, run='room', db=str(tmp_path/'room.db'))
    cap, watched = t.capture, []
    measure = cap._measure_kept
    cap._measure_kept = lambda ended=True: watched.append(sum(w[1].nbytes for w in cap._watched)) or measure(ended)
    for _ in range(3): net(torch.randn(512, 4096, device='meta')).sum().backward()
    t.flush()
    eager = dict(cap._eager)
    t.disarm()
    assert watched and max(watched) <= 5 * 2**20
    assert eager.get(cap.names.index('0')) is None and eager[cap.names.index('1')] is False
