"The read layer on a run's instruments: module sizes, call timings, scalars, steps, NaN provenance, JSON, snapshots, pictures."
import json, math, re, zlib
import numpy as np
import pandas as pd
import pytest, torch
from torchember.store import engine, create_run, write_step, snapshots_t
from torchember.query import load, Run, flow_order, decode_snapshot
from torchember.explore import Explorer
from torchember.figures import tensor_figure, tensor_image, latest_times, RED
from torchember.report import nonfinite, report_html

# A model `Sequential(block=Sequential(Linear), act=ReLU, head=Linear)`, module ids in registration order.
MODS = [('', 'Sequential', None, 19, 19, 76), ('block', 'Sequential', 0, 15, 15, 60), ('block.0', 'Linear', 1, 15, 15, 60),
        ('act', 'ReLU', 0, 0, 0, 0), ('head', 'Linear', 0, 4, 4, 16)]
def node(name, mtype, children=()): return {'name': name, 'short': name.rsplit('.', 1)[-1], 'type': mtype, 'children': list(children)}
TREE = node('', 'Sequential', [node('block', 'Sequential', [node('block.0', 'Linear')]), node('act', 'ReLU'), node('head', 'Linear')])
EVENTS = [('enter', 0, 0), ('enter', 1, 0), ('enter', 2, 0), ('exit', 2, 0), ('exit', 1, 0),
          ('enter', 3, 0), ('exit', 3, 0), ('enter', 4, 0), ('exit', 4, 0), ('exit', 0, 0)]
OUT = {0: (8, 1), 1: (8, 3), 2: (8, 3), 3: (8, 3), 4: (8, 1)}
PARAMS = {(2, 'weight'): ((3, 4), 2.), (2, 'bias'): ((3,), 1.), (4, 'weight'): ((1, 3), 2.), (4, 'bias'): ((1,), 0.)}

def row(mi, ttype, tname, shape=(8,), call=0, mean=.5, std=1., norm=1., nan=0, inf=0, nbytes='auto', extra=None):
    "A stats row in `ROW_FIELDS` order; a row with NaN or Inf gets non-finite stats, as a recording would."
    n = math.prod(shape)
    if nan or inf: mean = std = norm = math.nan if nan else math.inf
    return (mi, call, ttype, tname, json.dumps(list(shape)), 'float32', n, mean, std, mean - std, mean + std, norm, 0.,
            nan, inf, extra, 4 * n if nbytes == 'auto' else nbytes)

def forward(bad=()):
    "Inputs, outputs and weights of one forward; `bad`: module ids whose output held 8 NaN."
    rows = [row(2, 'input', 'input', (8, 4)), row(0, 'input', 'input', (8, 4)), row(3, 'attached', 'mask', (8, 3), mean=.5)]
    rows += [row(mi, 'output', 'output', shape, mean=mi, nan=8 if mi in bad else 0) for mi, shape in OUT.items()]
    return rows + [row(mi, 'weight', tn, shape, norm=nrm) for (mi, tn), (shape, nrm) in PARAMS.items()]

def backward(inf=(), nan=False, grad=3.):
    "Grads of one backward: output and input grads (per-sample norms), weight grads; `inf`: (module id, ttype) that held Inf; `nan`: all NaN."
    def bad(mi, tt, n): return dict(nan=n) if nan else dict(inf=n if (mi, tt) in inf else 0)
    rows = [row(mi, 'output_grad', 'output', **bad(mi, 'output_grad', 8)) for mi in OUT]
    rows += [row(mi, 'input_grad', 'input', **bad(mi, 'input_grad', 8)) for mi in (3, 4)]
    return rows + [row(mi, 'weight_grad', tn, shape, norm=grad if tn == 'weight' else 0., **bad(mi, 'weight_grad', math.prod(shape)))
                   for (mi, tn), (shape, _) in PARAMS.items()]

def timed(train=True, scale=1.):
    return [(mi, 0, train, scale * (mi + 1), scale * 2 * (mi + 1) if train else None) for mi in range(len(MODS))]

def put_snapshot(eng, rid, mi, ttype, tname, step, t, call=0):
    "Store `t` as a snapshot, encoded as a recording run encodes it."
    data = zlib.compress(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    with eng.begin() as c:
        c.execute(snapshots_t.insert().values(run_id=rid, module_id=mi, ttype=ttype, tname=tname, call=call, step=step,
                                              dtype=str(t.dtype).removeprefix('torch.'), shape=json.dumps(list(t.shape)), data=data))

@pytest.fixture
def run(db):
    """Run `inst`: step 0 clean; step 1 Inf in the backward from `head`'s input grad on; step 2 NaN from `act`'s output on
    (and NaN grads); step 3 clean, in eval mode. Timed, `loss` and `lr` logged, a few snapshots."""
    eng = engine(db)
    rid, _ = create_run(eng, 'inst', 'Sequential', MODS, TREE)
    spread = {(4, 'input_grad'), (3, 'output_grad'), (3, 'input_grad'), (1, 'output_grad'), (2, 'output_grad'), (2, 'weight_grad')}
    steps = [(forward(), backward(grad=3.)), (forward(), backward(inf=spread)),
             (forward(bad={3, 4, 0}), backward(nan=True)),
             (forward(), [])]
    for s, (fw, bw) in enumerate(steps):
        train = s < 3
        write_step(eng, rid, s, fw + bw, EVENTS, training=train, calls=timed(train, scale=s + 1),
                   scalars=dict(loss=1 / (s + 1), lr=.1) if train else dict(loss=.2))
    put_snapshot(eng, rid, 2, 'weight', 'weight', 0, torch.arange(12.).reshape(3, 4))
    put_snapshot(eng, rid, 2, 'weight', 'weight', 2, -torch.arange(12.).reshape(3, 4))
    put_snapshot(eng, rid, 2, 'weight_grad', 'weight', 1, torch.full((3, 4), math.inf))
    put_snapshot(eng, rid, 3, 'output', 'output', 3, torch.arange(24.).reshape(8, 3) - 12)
    return load('inst', db)

# modules, calls, scalars, steps

def test_modules(run, db):
    mo = run.modules()
    assert mo['module'].tolist() == ['', 'block', 'block.0', 'act', 'head']
    assert mo['parent'].tolist() == [None, '', 'block', '', '']
    assert mo['n_params'].tolist() == [19, 15, 15, 0, 4] and mo.loc[4, 'param_bytes'] == 16
    create_run(engine(db), 'old', 'Linear', [('', 'Linear', None)], node('', 'Linear'))   # a store without sizes
    old = load('old', db).modules()
    assert old['n_params'].isna().all() and old.loc[0, 'mtype'] == 'Linear'

def test_calls(run, db):
    c = run.calls()
    assert list(c.columns) == ['run', 'step', 'rank', 'module', 'mtype', 'call', 'training', 'fwd_ms', 'bwd_ms']
    assert len(c) == 4 * len(MODS) and (c['run'] == 'inst').all()
    s1 = run.calls(step=1, module=['head', 'act'])
    assert s1['module'].tolist() == ['act', 'head'] and s1['fwd_ms'].tolist() == [8., 10.] and s1['bwd_ms'].tolist() == [16., 20.]
    last = run.calls(step=3)
    assert last['training'].tolist() == [False] * 5 and last['bwd_ms'].isna().all()
    assert run.calls(step=[0, 1])['step'].unique().tolist() == [0, 1]
    create_run(engine(db), 'untimed', 'Linear', [('', 'Linear', None)], node('', 'Linear'))
    write_step(engine(db), load('untimed', db).id, 0, [row(0, 'output', 'output')], [('enter', 0, 0), ('exit', 0, 0)])
    empty = load('untimed', db).calls()
    assert empty.empty and list(empty.columns) == list(c.columns)

def test_scalars(run):
    sc = run.scalars()
    assert list(sc.columns) == ['step', 'rank', 'name', 'value'] and len(sc) == 7
    assert sc[sc['name'] == 'loss']['value'].tolist() == [1., .5, 1/3, .2]

def test_steps(run, db):
    st = run.steps()
    assert list(st.columns) == ['step', 'rank', 'iteration', 'kind', 'closed', 'training', 'n_records', 'grad_norm', 'weight_norm', 'loss', 'lr']
    assert st['step'].tolist() == [0, 1, 2, 3] and pd.api.types.is_datetime64_any_dtype(st['closed'])
    assert st['training'].tolist() == [True, True, True, False]
    assert st['grad_norm'].iloc[0] == pytest.approx(math.sqrt(3**2 + 3**2))   # two weight grads of norm 3, biases 0
    assert st['grad_norm'].iloc[1] == math.inf                                 # an Inf grad
    assert st['grad_norm'].iloc[2:].isna().all()                               # NaN grads; then no grads (eval)
    assert st['weight_norm'].tolist() == pytest.approx([math.sqrt(4 + 1 + 4)] * 4)
    assert st['n_records'].tolist() == [len(forward()) + len(backward())] * 3 + [len(forward())]
    assert st['lr'].isna().tolist() == [False, False, False, True]
    # one NaN grad among finite ones (its norm stored as NULL) makes the global norm unknown; a scalar named like a
    # column is renamed; an open step (rows written, not closed) is left out
    bw = backward()
    bw[-1] = row(4, 'weight_grad', 'bias', (1,), nan=1)
    write_step(engine(db), run.id, 4, forward() + bw, EVENTS, training=True, scalars={'step': 7., 'grad_norm': 1.})
    write_step(engine(db), run.id, 5, forward(), EVENTS, closed=False)
    st = run.steps()
    assert st['step'].tolist() == [0, 1, 2, 3, 4]
    assert st.loc[4, 'scalar_step'] == 7. and st.loc[4, 'scalar_grad_norm'] == 1. and math.isnan(st.loc[4, 'grad_norm'])

def test_steps_and_first_nonfinite_read_no_records(run, monkeypatch):
    "Both are aggregates in SQL: they never load the run's records."
    def boom(*a, **k): raise AssertionError('records loaded')
    monkeypatch.setattr(Run, 'df', boom)
    assert len(run.steps()) == 4
    assert run.first_nonfinite()['step'] == 1

# NaN provenance

def test_events_and_flow_order(run):
    ev = run.events(0)
    assert ev.iloc[3].tolist() == ['exit', 'block.0', 0] and len(ev) == len(EVENTS)
    recs = pd.DataFrame(dict(module=['', 'head', 'block.0', 'head', 'act', 'head', 'block', 'block.0'],
                             ttype=['output', 'weight', 'output_grad', 'output', 'input', 'input_grad', 'input_grad', 'input_grad']))
    fo = flow_order(recs, ev)
    assert fo[['module', 'ttype']].values.tolist() == [
        ['act', 'input'], ['head', 'output'], ['', 'output'],               # forward: as entered / returned
        ['head', 'input_grad'], ['block.0', 'output_grad'], ['block.0', 'input_grad'], ['block', 'input_grad'],   # backward
        ['head', 'weight']]                                                   # weights last

def test_first_nonfinite(run):
    assert run.first_nonfinite() == dict(step=1, rank=0, module='head', mtype='Linear', ttype='input_grad', tname='input', call=0,
                                         nan_count=0, inf_count=8)
    f2 = run.first_nonfinite(step=2)
    assert (f2['module'], f2['ttype'], f2['nan_count']) == ('act', 'output', 8)     # before `head` and the root, whose ids differ
    assert run.first_nonfinite(after=1)['step'] == 2
    assert run.first_nonfinite(after=2) is None
    assert run.first_nonfinite(step=0) is None and run.first_nonfinite(step=3) is None

def test_first_nonfinite_calls_attached_and_containers(db):
    "Two calls of one module: forward in call order, backward in reverse; an attached tensor before its module's output."
    eng = engine(db)
    mods = [('', 'Net', None), ('lin', 'Linear', 0), ('body', 'Sequential', 0), ('body.0', 'Linear', 2)]
    rid, _ = create_run(eng, 'calls', 'Net', mods, node('', 'Net', [node('lin', 'Linear'), node('body', 'Sequential', [node('body.0', 'Linear')])]))
    ev = [('enter', 0, 0), ('enter', 1, 0), ('exit', 1, 0), ('enter', 1, 1), ('exit', 1, 1),
          ('enter', 2, 0), ('enter', 3, 0), ('exit', 3, 0), ('exit', 2, 0), ('exit', 0, 0)]
    write_step(eng, rid, 0, [row(1, 'output', 'output', call=1, nan=3), row(1, 'attached', 'scores', call=1, nan=2),
                             row(0, 'attached', 'early', nan=1)], ev)
    write_step(eng, rid, 1, [row(1, 'output_grad', 'output', call=0, inf=1), row(1, 'output_grad', 'output', call=1, inf=1),
                             row(0, 'weight', 'w', nan=1), row(1, 'input', 'input', nan=1)], ev)
    write_step(eng, rid, 2, [row(2, 'input_grad', 'input', inf=2), row(3, 'input_grad', 'input', inf=2)], ev)
    r = load('calls', db)
    f0 = r.first_nonfinite(0)
    assert (f0['module'], f0['call'], f0['ttype'], f0['tname']) == ('lin', 1, 'attached', 'scores')
    f1 = r.first_nonfinite(1)                        # weights and inputs are not where a NaN is made
    assert (f1['module'], f1['call'], f1['ttype']) == ('lin', 1, 'output_grad')
    f2 = r.first_nonfinite(2)                        # a container's input grad is its first child's
    assert (f2['module'], f2['ttype']) == ('body.0', 'input_grad')

def test_first_nonfinite_without_events(db):
    eng = engine(db)
    rid, _ = create_run(eng, 'noev', 'Sequential', MODS, TREE)
    write_step(eng, rid, 0, [row(3, 'output', 'output', nan=1), row(4, 'output', 'output', nan=1)])
    f = load('noev', db).first_nonfinite()
    assert (f['step'], f['module']) == (0, 'act')   # no order known: the store's own (module id)

def test_report_uses_flow_order(run):
    nf = nonfinite(run)
    first = nf[nf['first_step'] == 1]
    assert first[['module', 'ttype']].values.tolist()[:3] == [['head', 'input_grad'], ['act', 'output_grad'], ['act', 'input_grad']]
    assert nf['first_step'].is_monotonic_increasing
    page = report_html(run)
    assert 'First NaN/Inf: <b>head</b> (Linear) input_grad input at step 1, call 0' in page

# to_json

def test_to_json(run, tmp_path):
    j = run.to_json()
    assert list(j) == ['Sequential']
    root = j['Sequential']
    assert list(root['children']) == ['block', 'act', 'head'] and list(root['children']['block']['children']) == ['0']
    lin = root['children']['block']['children']['0']['info']
    assert lin == dict(name='block.0', type='Linear', n_params=15, n_learnable=15, param_bytes=60, input_bytes=128,
                       output_bytes=96, grad_bytes=0, fwd_ms=12., bwd_ms=None, output_nonfinite=False, grad_nonfinite=False,
                       output_mean=2., output_std=1.)
    s1 = run.to_json(step=1)['Sequential']['children']
    assert s1['block']['children']['0']['info']['grad_bytes'] == 60 and s1['head']['info']['bwd_ms'] == 20.
    assert s1['head']['info']['grad_nonfinite'] is True and s1['block']['info']['grad_nonfinite'] is True
    s2 = run.to_json(step=2)['Sequential']
    assert s2['children']['act']['info']['output_nonfinite'] is True and s2['info']['output_mean'] is None   # NaN -> null
    base = tmp_path/'json'
    p = base/'out'/'inst.json'
    assert run.to_json(p, step=2) == {'Sequential': s2}
    assert json.loads(p.read_text()) == {'Sequential': s2}
    assert 'NaN' not in p.read_text() and 'Infinity' not in p.read_text()
    with pytest.raises(IsADirectoryError, match='is a directory'): run.to_json(base/'out')
    assert [x.relative_to(base).as_posix() for x in sorted(base.rglob('*'))] == ['out', 'out/inst.json']

def test_to_json_untimed_and_unsized(db):
    eng = engine(db)
    rid, _ = create_run(eng, 'bare', 'Linear', [('', 'Linear', None)], node('', 'Linear'))
    write_step(eng, rid, 0, [row(0, 'output', 'output', nbytes=None)], [('enter', 0, 0), ('exit', 0, 0)])
    info = load('bare', db).to_json()['Linear']['info']
    assert (info['n_params'], info['fwd_ms'], info['output_bytes'], info['grad_bytes']) == (None, None, None, 0)

# snapshots

def test_snapshot_at_step(run):
    w = torch.arange(12.).reshape(3, 4)
    assert torch.equal(run.snapshot('block.0', 'weight', step=0, ttype='weight'), w)
    assert torch.equal(run.snapshot('block.0', 'weight', step=1, ttype='weight'), w)      # unchanged since step 0
    assert torch.equal(run.snapshot('block.0', 'weight', ttype='weight'), -w)             # latest: step 3, snapshot of step 2
    assert torch.equal(run.snapshot('act', 'output'), torch.arange(24.).reshape(8, 3) - 12)   # ttype inferred
    assert run.snapshot('block.0', 'weight', ttype='weight_grad').isinf().all()
    s = run.snapshots()
    assert s[['module', 'ttype', 'step']].values.tolist() == [['block.0', 'weight', 0], ['block.0', 'weight', 2],
                                                              ['block.0', 'weight_grad', 1], ['act', 'output', 3]]
    assert s.loc[0, 'shape'] == (3, 4)

def test_snapshot_errors(run):
    with pytest.raises(ValueError, match='weight and weight_grad: pass ttype='): run.snapshot('block.0', 'weight')
    with pytest.raises(KeyError, match=r"at or before step 0.*'block.0' weight_grad weight at step 1"):
        run.snapshot('block.0', 'weight', step=0, ttype='weight_grad')
    with pytest.raises(KeyError, match=r"it has none of 'head'; the run has 'block.0' weight weight at steps 0, 2"):
        run.snapshot('head', 'weight')
    with pytest.raises(KeyError, match=r"\(call 1\)"): run.snapshot('act', 'output', call=1)

@pytest.mark.parametrize('t', [torch.randn(2, 3).half(), torch.randn(5).bfloat16(), torch.arange(-3, 3), torch.tensor([True, False]),
                               torch.randn(2, 2, dtype=torch.complex64), torch.empty(0, 4), torch.tensor(3.5, dtype=torch.float64)])
def test_snapshot_dtypes(db, t):
    eng = engine(db)
    rid, _ = create_run(eng, 'dt', 'Linear', [('', 'Linear', None)], node('', 'Linear'))
    write_step(eng, rid, 0, [], [])
    put_snapshot(eng, rid, 0, 'output', 'output', 0, t)
    got = load('dt', db).snapshot('', 'output')
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)

def test_decode_snapshot_refuses_bad_data():
    data = zlib.compress(torch.zeros(4).numpy().tobytes())
    assert torch.equal(decode_snapshot('float32', '[2, 2]', data), torch.zeros(2, 2))
    with pytest.raises(ValueError, match='corrupt snapshot'): decode_snapshot('float32', '[3]', data)
    with pytest.raises(ValueError, match='corrupt snapshot'): decode_snapshot('float32', '[5]', data)
    with pytest.raises(ValueError, match='unknown dtype'): decode_snapshot('manual_seed', '[4]', data)
    bomb = zlib.compress(bytes(10**7))
    with pytest.raises(ValueError, match='more than 4 bytes'): decode_snapshot('float32', '[1]', bomb)   # never inflated whole

# pictures

def test_tensor_image_shapes():
    assert tensor_image(torch.arange(5.)).shape == (1, 5)
    m = torch.randn(3, 7)
    assert np.array_equal(tensor_image(m), m.double().numpy())
    seq = torch.randn(2, 5, 6)                      # (batch, tokens, features): the first sample
    assert np.array_equal(tensor_image(seq), seq[0].double().numpy())
    fm = torch.randn(2, 5, 4, 3)                    # 5 channels -> 3 columns, 2 rows of tiles
    img = tensor_image(fm)
    assert img.shape == (2 * 5 - 1, 3 * 4 - 1)
    assert np.array_equal(img[5:9, 4:7], fm[0, 4].double().numpy()) and np.isnan(img[4]).all() and np.isnan(img[5:, 8:]).all()
    assert tensor_image(torch.randn(1, 100, 2, 2), max_tiles=9).shape == (3 * 3 - 1, 3 * 3 - 1)
    assert tensor_image(torch.empty(0, 3)).shape == (0, 0)

def test_tensor_figure_kinds():
    t = torch.tensor([[1., -2.], [float('inf'), 4.]])
    h = tensor_figure(t)
    z = np.asarray(h.data[0].z, dtype=float)
    assert h.data[0].type == 'heatmap' and z[0, 1] == -2 and np.isnan(z[1, 0]) and h.data[0].zmid == 0
    assert h.layout.yaxis.autorange == 'reversed' and '0 NaN, 1 Inf left out' in h.layout.title.text
    hist = tensor_figure(torch.cat([torch.zeros(10), torch.ones(30), torch.tensor([math.nan])]), 'hist', bins=2)
    assert hist.data[0].type == 'bar' and list(hist.data[0].y) == [10, 30]
    assert list(tensor_figure(torch.full((4,), 2.), 'hist', bins=3).data[0].y) == [0, 4, 0]
    fm = tensor_figure(torch.randn(2, 100, 3, 3), max_tiles=16)
    assert 'sample 0 · first 16 of 100 channels' in fm.layout.title.text
    with pytest.raises(ValueError, match='at least one bin'): tensor_figure(t, 'hist', bins=0)
    with pytest.raises(ValueError, match="unknown kind 'pie'"): tensor_figure(t, 'pie')

def test_pca():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(20, 6, 3, generator=g)
    a[10:] += 5                                          # two groups of samples
    a[3, 0, 0] = math.nan
    f = tensor_figure(a, 'pca')
    pc1 = np.asarray(f.data[0].x)
    assert len(pc1) == 19 and 'sample 3' not in f.data[0].text and '1 samples with NaN/Inf left out' in f.layout.title.text
    first, second = pc1[:9], pc1[9:]
    assert (np.sign(first) == np.sign(first[0])).all() and (np.sign(second) == -np.sign(first[0])).all()
    share = float(re.search(r'\((\d+)%', f.layout.xaxis.title.text).group(1))
    assert share > 50
    rng = torch.get_rng_state()
    big = tensor_figure(torch.randn(300, 300, generator=g), 'pca')   # the randomized path
    assert torch.equal(rng, torch.get_rng_state()) and len(big.data[0].x) == 300
    one = tensor_figure(torch.randn(5, 1, generator=g), 'pca')        # a single feature: PC2 is 0
    assert set(one.data[0].y) == {0.0}
    with pytest.raises(ValueError, match='needs a batch'): tensor_figure(torch.randn(1, 4), 'pca')
    with pytest.raises(ValueError, match='without NaN/Inf'): tensor_figure(torch.full((3, 2), math.nan), 'pca')

def test_picture(run):
    f = run.picture('block.0', 'weight', step=1, ttype='weight')
    assert np.array_equal(np.asarray(f.data[0].z), torch.arange(12.).reshape(3, 4).numpy())
    assert f.layout.title.text.startswith('inst · block.0 weight at step 1 · (3, 4)')
    p = run.picture('act', 'output', kind='pca')
    assert p.data[0].type == 'scatter' and len(p.data[0].x) == 8
    with pytest.raises(KeyError, match='no snapshot'): run.picture('head', 'weight')

# the explorer on the new instruments

def test_latest_times(run):
    lt = latest_times(run)
    assert lt['module'].tolist() == ['', 'block', 'block.0', 'act', 'head']
    assert lt['fwd_ms'].tolist() == [4., 8., 12., 16., 20.] and lt['bwd_ms'].isna().all() and (lt['n_calls'] == 1).all()
    assert latest_times(run, step=0)['bwd_ms'].tolist() == [2., 4., 6., 8., 10.]

def test_explorer_offers_new_tensors_and_timings(run, db):
    ex = Explorer(db, run='inst')
    try:
        ex.select('act')
        assert ex.ttype_picker.options == ('output', 'attached', 'output_grad', 'input_grad')
        ex.ttype_picker.value = 'input_grad'
        assert ex.history_df['step'].tolist() == [0, 1, 2]
        assert [v for _, v in ex.ov_ttype.options] == ['input', 'output', 'attached', 'weight', 'weight_grad', 'output_grad', 'input_grad', 'time']
        assert ex.ov_ttype.value == 'weight_grad'
        ex.ov_ttype.value = 'time'
        bars = ex.plots['bars'].data[0]
        assert ex.ov_stat.options == ('fwd_ms', 'bwd_ms', 'n_calls') and ex.ov_stat.value == 'fwd_ms'
        assert list(bars.customdata) == ['', 'block', 'block.0', 'act', 'head'] and list(bars.y) == [4., 8., 12., 16., 20.]
        assert ex.plots['bars'].title.startswith('step 3: fwd_ms per module')
    finally: ex.close()

def test_explorer_names_and_flags_the_first_nonfinite(run, db):
    ex = Explorer(db, run='inst')
    try:
        assert ex.status.value.endswith(' · 4 steps · first NaN/Inf: head (Linear) input_grad at step 1')
        ex.ov_ttype.value = 'output'                       # step 3 is clean: only the flagged module is red
        colors = list(ex.plots['bars'].data[0].marker.color)
        assert [c == RED for c in colors] == [False, False, False, False, True]
        ex.ov_ttype.value = 'weight'                       # the flagged module has weights: in view, red
        bars = ex.plots['bars'].data[0]
        assert list(bars.customdata) == ['block.0', 'head'] and [c == RED for c in bars.marker.color] == [False, True]
        ex.ov_ttype.value = 'attached'                     # not in view: nothing red
        assert list(ex.plots['bars'].data[0].customdata) == ['act'] and ex.plots['bars'].data[0].marker.color[0] != RED
    finally: ex.close()

def test_explorer_finds_nonfinite_in_new_steps(db):
    eng = engine(db)
    rid, _ = create_run(eng, 'later', 'Sequential', MODS, TREE)
    for s in range(3): write_step(eng, rid, s, forward() + backward(), EVENTS, training=True)
    ex = Explorer(db, run='later')
    try:
        assert 'NaN' not in ex.status.value and ex._first_bad is None
        write_step(eng, rid, 3, forward(bad={3}), EVENTS, training=True)
        assert ex.poll() is True
        assert ex.status.value.endswith('first NaN/Inf: act (ReLU) output at step 3')
        write_step(eng, rid, 4, forward(bad={2}), EVENTS, training=True)   # a later one does not replace the first
        assert ex.poll() is True and ex.status.value.endswith('at step 3')
    finally: ex.close()
