"The opt-in instruments on real models: they record what they promise, in the store, and never change training."
import copy, json, sqlite3
import pytest, torch
from torch import nn
from corpus import CORPUS, loss_of
from torchember import torchEmber, load
from torchember.core import record_tensor
from torchember.instruments import decode_tensor

ALL = dict(timing=True, io_grad=True, hist=16, track_updates=True, snapshot=['*.weight.grad'])

def sql(db, q, *args):
    with sqlite3.connect(db) as c: return c.execute(q, args).fetchall()

def train(model, make_batch, steps, te=None, opt=None):
    for s in range(steps):
        args, kwargs = make_batch(s)
        torch.manual_seed(s)
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        if te is not None: te.log(loss=loss)
        if opt is not None: opt.step()
        for p in model.parameters(): p.grad = None

@pytest.mark.parametrize('name', ['resnet', 'lstm', 'transformer', 'kwargs_dict', 'shared_twice'])
def test_all_instruments_leave_training_bit_for_bit(name, db):
    "Every instrument on at once (io_grad's tensor hooks included, with in-place ReLUs and residual adds): same outputs and grads."
    model, make_batch = CORPUS[name]()
    bare = copy.deepcopy(model)
    te = torchEmber(model, run=name, db=db, **ALL)
    for s in range(2):
        args, kwargs = make_batch(s)
        outs = []
        for m in (bare, model):
            torch.manual_seed(s)
            loss = loss_of(m(*args, **kwargs)); loss.backward(); outs.append(loss)
        assert torch.equal(*outs)
        for (n, p1), (_, p2) in zip(bare.named_parameters(), model.named_parameters(), strict=True):
            assert (p1.grad is None) == (p2.grad is None), n
            if p1.grad is not None: assert torch.equal(p1.grad, p2.grad), n
            p1.grad = p2.grad = None
    te.disarm()
    ttypes = {t for (t,) in sql(db, "SELECT DISTINCT ttype FROM stats")}
    assert {'input', 'output', 'weight', 'weight_grad', 'output_grad'} <= ttypes

def test_io_grad_norms_are_per_sample_and_survive_in_place_ops(db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    te = torchEmber(model, run='io', db=db, io_grad=True)
    x = torch.randn(5, 3)
    out = model(x)
    w = torch.arange(10.).reshape(5, 2)
    (out * w).sum().backward()
    df = te.latest()
    g = df[(df.module == '2') & (df.ttype == 'output_grad')].iloc[0]
    per_sample = w.norm(dim=1)                                   # d(sum(out*w))/d out = w
    assert g['numel'] == 5 and g['max'] == pytest.approx(per_sample.max().item())
    assert g['norm'] == pytest.approx(w.norm().item())
    relu_in = df[(df.module == '1') & (df.ttype == 'input_grad')].iloc[0]
    # the ReLU changed its input in place; its input grad is still the grad w.r.t. the value before the ReLU
    expected = (w @ model[2].weight) * (model[0](x) > 0).float()
    assert relu_in['norm'] == pytest.approx(expected.norm().item(), rel=1e-5)
    te.disarm()

def test_timing_rows_one_per_call(db):
    model, make_batch = CORPUS['shared_twice']()
    te = torchEmber(model, run='t', db=db, timing=True)
    train(model, make_batch, 2)
    te.disarm()
    rows = sql(db, "SELECT m.name, c.call, c.fwd_ms, c.bwd_ms FROM calls c JOIN modules m ON m.run_id = c.run_id AND m.id = c.module_id WHERE c.step = 1")
    calls = {}
    for name, call, fwd, bwd in rows: calls.setdefault(name, []).append((call, fwd, bwd))
    twice = [n for n, v in calls.items() if len(v) == 2]
    assert twice, "the module called twice has two timed calls"
    assert all(f is not None and f >= 0 for v in calls.values() for _, f, _ in v)
    assert any(b is not None and b > 0 for v in calls.values() for _, _, b in v)
    assert sql(db, "SELECT DISTINCT training FROM calls") == [(1,)]

def test_module_selection_and_eval_mode(db):
    model, make_batch = CORPUS['resnet']()
    te = torchEmber(model, run='sel', db=db, modules=[nn.Conv2d, 'fc'], record_eval=False)
    train(model, make_batch, 1)
    model.eval()
    with torch.no_grad(): model(*make_batch(1)[0])
    model.train()
    train(model, make_batch, 1)
    df = te.df()
    types = set(df.mtype)
    assert types <= {'Conv2d', 'Linear'} and 'Conv2d' in types
    assert sorted(df.step.unique()) == [0, 1]                     # the eval call was not a step
    assert sql(db, "SELECT step, training FROM steps ORDER BY step") == [(0, 1), (1, 1)]
    te.disarm()

def test_eval_calls_are_recorded_with_their_mode(db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    te = torchEmber(model, run='modes', db=db)
    model(torch.randn(2, 3)); model.eval(); model(torch.randn(2, 3))
    te.disarm()
    assert sql(db, "SELECT step, training FROM steps ORDER BY step") == [(0, 1), (1, 0)]

def test_attach_records_an_inner_tensor(db):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        def forward(self, x):
            a = record_tensor(torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1), self, 'attn')
            return a @ x
    model = nn.Sequential(Attn(), nn.Linear(4, 1))
    te = torchEmber(model, run='attach', db=db, snapshot='0.attn')
    x = torch.randn(2, 3, 4)
    model(x).sum().backward()
    df = te.latest()
    row = df[(df.ttype == 'attached')].iloc[0]
    assert (row.module, row.tname, row['shape']) == ('0', 'attn', (2, 3, 3))
    assert row['mean'] == pytest.approx(1 / 3)                     # rows of a softmax over 3 keys
    (dtype, shape, data), = sql(db, "SELECT dtype, shape, data FROM snapshots")
    a = decode_tensor(dtype, shape, data)
    assert a.shape == (2, 3, 3) and torch.allclose(a.sum(-1), torch.ones(2, 3))
    te.disarm()

def test_snapshots_only_when_changed_and_fn_applied(db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].requires_grad_(False)                                 # frozen: its weight never changes
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    te = torchEmber(model, run='snap', db=db, snapshot=['0.weight', '1.weight', '1.output'], snapshot_fn=lambda t: t[:1])
    for _ in range(4):
        model(torch.randn(5, 3)).sum().backward(); opt.step(); opt.zero_grad()
    te.disarm()
    counts = dict(sql(db, "SELECT m.name || '.' || s.tname, COUNT(*) FROM snapshots s JOIN modules m ON m.run_id = s.run_id AND m.id = s.module_id GROUP BY 1"))
    assert counts == {'0.weight': 1, '1.weight': 4, '1.output': 4}
    shapes = {json.loads(s) == [1, 3] or json.loads(s) == [1, 1] for (s,) in sql(db, "SELECT shape FROM snapshots")}
    assert shapes == {True}

def test_histograms_with_outliers_and_sampling(db):
    model = nn.Sequential(nn.Linear(200, 300))
    te = torchEmber(model, run='hist', db=db, hist=10, sample_n=1000, outliers=3.0)
    with torch.no_grad(): model[0].weight[0, 0] = 1e4
    model(torch.randn(4, 200)).sum().backward()
    df = te.latest()
    w = df[(df.ttype == 'weight') & (df.tname == 'weight')].iloc[0]
    assert len(w['hist']) == 10 and sum(w['hist']) + w['hist_out'] == 1000
    assert w['hist_hi'] < 1e4 and w['max'] == 1e4                 # the histogram's range left the outlier out; the stats did not
    te.disarm()

def test_log_update_norms_and_pausing(db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    te = torchEmber(model, run='log', db=db, track_updates=True)
    w0 = model[0].weight.detach().clone()
    for i in range(4):
        te.enabled = i != 2
        loss = model(torch.randn(8, 3)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        te.log(loss=loss, lr=0.5)
        if i == 2: w_before3 = model[0].weight.detach().clone()
    te.disarm()
    assert sql(db, "SELECT step FROM steps ORDER BY step") == [(0,), (1,), (3,)]
    assert [s for (s,) in sql(db, "SELECT DISTINCT step FROM scalars ORDER BY step")] == [0, 1, 2, 3]
    df = load('log', db).df(ttype='weight', module='0', tname='weight')
    last = df[df.step == 3].iloc[0]
    assert last['init_dist'] == pytest.approx((w_before3 - w0).norm().item(), rel=1e-5)    # weights as step 3 began
    assert df[df.step == 0].iloc[0]['update_norm'] == 0
    with pytest.raises(TypeError, match="numbers or one-element tensors"): te.log(loss="low")

def test_module_sizes_and_bytes(db):
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 1).requires_grad_(False))
    te = torchEmber(model, run='sizes', db=db)
    model(torch.randn(4, 10)).sum().backward()
    df = te.latest()
    te.disarm()
    mods = dict((n, (a, b, c)) for n, a, b, c in sql(db, "SELECT name, n_params, n_learnable, param_bytes FROM modules"))
    assert mods == {'': (241, 220, 964), '0': (220, 220, 880), '1': (21, 0, 84)}
    out = df[(df.module == '0') & (df.ttype == 'output')].iloc[0]
    assert out['nbytes'] == 4 * 20 * 4

def test_a_version_1_store_opens_and_reads(tmp_path):
    "A store written by schema version 1 (stats with rowid and two indexes, no nbytes or new tables) is upgraded in place."
    db = str(tmp_path/'v1.db')
    with sqlite3.connect(db) as c:
        c.executescript("""
        CREATE TABLE meta (key VARCHAR PRIMARY KEY, value TEXT);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE runs (id INTEGER PRIMARY KEY, name VARCHAR NOT NULL UNIQUE, model VARCHAR, started FLOAT, user VARCHAR,
                           host VARCHAR, torch VARCHAR, tree TEXT, config TEXT, last_step INTEGER);
        CREATE TABLE modules (run_id INTEGER NOT NULL REFERENCES runs(id), id INTEGER NOT NULL, name VARCHAR NOT NULL,
                              mtype VARCHAR, parent INTEGER, PRIMARY KEY (run_id, id));
        CREATE TABLE steps (run_id INTEGER NOT NULL, step INTEGER NOT NULL, closed FLOAT, n_records INTEGER,
                            events_step INTEGER, PRIMARY KEY (run_id, step));
        CREATE TABLE events (run_id INTEGER NOT NULL, step INTEGER NOT NULL, seq INTEGER NOT NULL, kind VARCHAR NOT NULL,
                             module_id INTEGER NOT NULL, call INTEGER, PRIMARY KEY (run_id, step, seq));
        CREATE TABLE stats (run_id INTEGER NOT NULL, step INTEGER NOT NULL, module_id INTEGER NOT NULL, call INTEGER NOT NULL,
                            ttype VARCHAR NOT NULL, tname VARCHAR NOT NULL, shape VARCHAR, dtype VARCHAR, numel FLOAT, mean FLOAT,
                            std FLOAT, min FLOAT, max FLOAT, norm FLOAT, zero_frac FLOAT, nan_count FLOAT, inf_count FLOAT, extra TEXT);
        CREATE INDEX stats_step ON stats (run_id, step, module_id);
        CREATE INDEX stats_module ON stats (run_id, module_id, step);
        INSERT INTO runs VALUES (1, 'old', 'Sequential', 0, 'u', 'h', '2.0', '{"name": "", "short": "", "type": "Sequential", "children": []}', '{}', 0);
        INSERT INTO modules VALUES (1, 0, '', 'Sequential', NULL);
        INSERT INTO steps VALUES (1, 0, 0, 1, 0);
        INSERT INTO events VALUES (1, 0, 0, 'enter', 0, 0), (1, 0, 1, 'exit', 0, 0);
        INSERT INTO stats VALUES (1, 0, 0, 0, 'output', 'output', '[2]', 'float32', 2, 0.5, 0.1, 0, 1, 1, 0, 0, 0, NULL);
        """)
    r = load('old', db)
    assert r.latest()['mean'].tolist() == [0.5] and r.sequence() == ['enter ', 'exit ']
    assert r.latest()['absmax'].tolist() == [1.0]   # read from its min and max
    assert sql(db, "SELECT value FROM meta WHERE key = 'schema_version'") == [('3',)]
    model = nn.Sequential(nn.Linear(2, 2))
    with torchEmber(model, run='new', db=db): model(torch.randn(1, 2)).sum().backward()
    assert len(load('new', db).latest()) > 0 and load('old', db).n_steps == 1
