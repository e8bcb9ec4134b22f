"""The writer folds completed bins, and the wider bins around them, from the module values it computed as it wrote the
steps (`store.rollups._fold_known`, `_fold_wider`): the `rollups` it leaves must be those the SQL fold (`roll_up`) computes from
the stored rows, NaN steps included."""
import math
import pytest, torch
from torch import nn
from torchember import torchEmber
from torchember import store
from torchember.store import roll_up, _known, _wide

pytestmark = pytest.mark.usefixtures('thread_writer')   # they watch or patch the writer's work in this process

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

class Spread(nn.Module):
    "Each input column repeated: an output over 1 MiB, which is measured at its hook while the small ones wait."
    def forward(self, x): return x.repeat(1, 11_000)

class WideNet(Net):
    "`Net` with an activation of over 1 MiB in the middle: its first step's rows come in another order than the later ones'."
    def __init__(self):
        super().__init__()
        self.spread = Spread()
    def forward(self, x): return self.b(self.act(self.a(self.spread(x).reshape(4, 11_000, 6).mean(1))))

def check_folds(db, every, monkeypatch, from_memory=True, steps=70, forget_at=None, net=Net):
    "Train a small net into store `db`, then fold its bins again in SQL: the same bins, each from memory (or each in SQL)."
    took, fold, refolds, refold = [], store.rollups._fold_known, [], store.rollups._refold
    monkeypatch.setattr(store.rollups, '_fold_known', lambda *a: took.append(fold(*a)) or took[-1])
    monkeypatch.setattr(store.rollups, '_refold', lambda *a, **k: refolds.append(k.get('widths')) or refold(*a, **k))
    torch.manual_seed(0)
    net = net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    t = torchEmber(net, run='fold', db=db, every=every)
    for step in range(steps):
        if step == forget_at: t.flush(); _wide.clear()   # as a new process resuming the run would find it
        x = torch.randn(4, 6)
        if step == 21: x[0, 0] = float('nan')            # a NaN step: its bins name it
        net(x).sum().backward(); opt.step(); opt.zero_grad()
    t.flush()
    if from_memory is not None: assert took and all(took) if from_memory else not any(took)   # each bin folded from memory (or none)
    if from_memory and forget_at is None: assert not refolds        # and the wider bins too, none again in SQL
    t._refolds, t._took = refolds, took
    folded = _rollups(t.engine, t.run_id)
    assert any(k[3] == 8 for k in folded) and any(v[7] is not None for v in folded.values())
    with t.engine.begin() as c:
        c.exec_driver_sql(f'DELETE FROM rollups WHERE run_id = {t.run_id}')
        roll_up(c, t.run_id, last=max(k[4] for k in folded if k[3] == 8) * 8 + 7)
    _same(folded, _rollups(t.engine, t.run_id))
    t.disarm()
    return t

@pytest.mark.parametrize('every', [1, 3])
def test_folds_from_memory_equal_the_sql_fold(tmp_path, every, monkeypatch): check_folds(str(tmp_path/'f.db'), every, monkeypatch)

def test_steps_whose_rows_come_in_another_order_are_folded_from_memory(tmp_path, monkeypatch):
    check_folds(str(tmp_path/'f.db'), 1, monkeypatch, net=WideNet)

@pytest.mark.parametrize('every', [1, 5])
def test_wider_bins_from_memory_over_a_longer_run(tmp_path, every, monkeypatch):
    t = check_folds(str(tmp_path/'f.db'), every, monkeypatch, steps=300)   # bins of 8, 32 and 128 completed, 512 begun
    assert {k[3] for k in _rollups_of(t)} >= {8, 32, 128, 512}

def _rollups_of(t): return _rollups(t.engine, t.run_id)

def test_a_wider_bin_begun_before_the_writer_knew_it_is_folded_in_sql(tmp_path, monkeypatch):
    "A wider bin whose first steps this writer did not fold (a resumed run) is folded again in SQL until the next one begins."
    t = check_folds(str(tmp_path/'f.db'), 1, monkeypatch, steps=150, forget_at=44)
    assert (32,) in t._refolds and (128,) in t._refolds      # the bins of 32 and 128 under way at step 44 went to SQL
    assert t._refolds.count((32,)) <= 3                      # then the next bin of 32, from step 64, was folded from memory

def test_late_rows_hand_the_wider_bins_to_sql(tmp_path):
    "Rows that come after their bin was folded fold it again in SQL, and the writer forgets the wider bins it was filling."
    from torchember.store import create_run, write_step, write_steps
    eng = store.engine(str(tmp_path/'f.db'))
    rid, _ = create_run(eng, 'late', 'Net', [('', 'Net', None), ('a', 'Linear', None)], {'name': ''})
    def row(m, mean): return (m, 0, 'output', 'output', '[2]', 'float32', 2, mean, 0.5, 0., 1., 2., 0., 0, 0, None, 8)
    for s in range(20): write_step(eng, rid, s, [row(1, float(s))])
    assert (rid, 0) in _wide.get(eng, {})
    write_steps(eng, rid, [dict(step=3, rows=[row(0, 100.)], closed=False),   # late rows of step 3, whose bin was folded
                           dict(step=20, rows=[row(1, 20.)])])                 # written with the next closed step
    assert (rid, 0) not in _wide.get(eng, {})
    got = _rollups(eng, rid)
    with eng.begin() as c:
        c.exec_driver_sql(f'DELETE FROM rollups WHERE run_id = {rid}')
        roll_up(c, rid, last=15)
    _same(got, _rollups(eng, rid))

def test_a_write_that_fails_after_folding_is_folded_again_right(tmp_path, monkeypatch):
    "A write that folded bins in memory, then failed (store locked), is written again: its NaN steps are counted once."
    import sqlite3
    from torchember.store import create_run, write_steps
    eng = store.engine(str(tmp_path/'f.db'))
    rid, _ = create_run(eng, 'retry', 'Net', [('', 'Net', None), ('a', 'Linear', None)], {'name': ''})
    def row(s): return (1, 0, 'output', 'output', '[2]', 'float32', 2, float(s), 0.5, 0., 1., 2., 0., int(s in (19, 21)), 0, None, 8)
    steps = [dict(step=s, rows=[row(s)]) for s in range(25)]   # a first batch that completes the bins of steps 0-23
    closed, fail = store.write.roll_up_closed, []
    def locked_once(*a, **k):
        closed(*a, **k)
        if not fail: fail.append(1); raise sqlite3.OperationalError('database is locked')
    monkeypatch.setattr(store.write, 'roll_up_closed', locked_once)
    with pytest.raises(sqlite3.OperationalError): write_steps(eng, rid, steps)
    write_steps(eng, rid, steps)                                # as the writer does with a batch the store was too busy for
    got = _rollups(eng, rid)
    assert got[(rid, 0, 'output', 32, 0, 1)][8] == 2            # two NaN steps in the bin of 32, counted once
    with eng.begin() as c:
        c.exec_driver_sql(f'DELETE FROM rollups WHERE run_id = {rid}')
        roll_up(c, rid, last=23)
    _same(got, _rollups(eng, rid))

def test_late_rows_written_alone_are_folded(tmp_path):
    "Rows that come late to a folded bin, in a write that closes no step (a backward after `flush()`), are folded too."
    from torchember.store import create_run, write_step, write_steps
    eng = store.engine(str(tmp_path/'f.db'))
    rid, _ = create_run(eng, 'late', 'Net', [('', 'Net', None), ('a', 'Linear', None)], {'name': ''})
    def row(tname, mean): return (1, 0, 'output', tname, '[2]', 'float32', 2, mean, 0.5, 0., 1., 2., 0., 0, 0, None, 8)
    for s in range(20): write_step(eng, rid, s, [row('output', float(s))])
    write_steps(eng, rid, [dict(step=3, rows=[row('extra', 1000.)], closed=False)])
    got = _rollups(eng, rid)
    assert got[(rid, 0, 'output', 8, 0, 1)][2] == 501.5   # the bin's largest mean: step 3's, its late row (1000) counted
    with eng.begin() as c:
        c.exec_driver_sql(f'DELETE FROM rollups WHERE run_id = {rid}')
        roll_up(c, rid, last=15)
    _same(got, _rollups(eng, rid))
