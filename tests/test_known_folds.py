"""The writer folds completed bins from the module values it computed as it wrote the steps (`store._fold_known`):
the `rollups` it leaves must be those the SQL fold (`roll_up`) computes from the stored rows, NaN steps included."""
import math
import pytest, torch
from torch import nn
from torchember import torchEmber
from torchember import store
from torchember.store import roll_up, _known

COLS = 'run_id, rank, ttype, width, bin, module_id, norm_sq, std_sq, mean_hi, mean_lo, zero_frac, hi, lo, bad_step, bad_steps'

def _rollups(eng, run_id):
    with eng.connect() as c:
        return {tuple(r[:6]): tuple(r[6:]) for r in c.exec_driver_sql(f'SELECT {COLS} FROM rollups WHERE run_id = {run_id}')}

def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k]):
            if x is None or y is None: assert x is None and y is None, (k, a[k], b[k])
            else: assert x == y or math.isclose(x, y, rel_tol=1e-12) or x != x and y != y, (k, a[k], b[k])   # NaN: a value in PostgreSQL

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(6, 8), nn.Linear(8, 3), nn.ReLU()
    def forward(self, x): return self.b(self.act(self.a(x)))

def check_folds(db, every, monkeypatch, from_memory=True):
    "Train a small net into store `db`, then fold its bins again in SQL: the same bins, each folded from memory (or each in SQL)."
    took, fold = [], store._fold_known
    monkeypatch.setattr(store, '_fold_known', lambda *a: took.append(fold(*a)) or took[-1])
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    t = torchEmber(net, run='fold', db=db, every=every)
    for step in range(70):
        x = torch.randn(4, 6)
        if step == 21: x[0, 0] = float('nan')            # a NaN step: its bins name it
        net(x).sum().backward(); opt.step(); opt.zero_grad()
    t.flush()
    assert took and all(took) if from_memory else not any(took)   # every completed bin folded from the module values kept
    folded = _rollups(t.engine, t.run_id)
    assert any(k[3] == 8 for k in folded) and any(v[7] is not None for v in folded.values())
    with t.engine.begin() as c:
        c.exec_driver_sql(f'DELETE FROM rollups WHERE run_id = {t.run_id}')
        roll_up(c, t.run_id, last=max(k[4] for k in folded if k[3] == 8) * 8 + 7)
    _same(folded, _rollups(t.engine, t.run_id))
    t.disarm()

@pytest.mark.parametrize('every', [1, 3])
def test_folds_from_memory_equal_the_sql_fold(tmp_path, every, monkeypatch): check_folds(str(tmp_path/'f.db'), every, monkeypatch)
