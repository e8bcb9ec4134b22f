"The explorer widget and the static report, driven from Python on a store written by real training runs."
import math, re, subprocess, sys, threading, time
from pathlib import Path
import numpy as np
import pytest, torch
from torch import nn
from plotly.callbacks import Points, InputDeviceState
from torchember import torchEmber, load
from torchember import hist_stats
from torchember.explore import Explorer, explore
from torchember.figures import history, combine, thin, heat
from torchember.report import report, page_figures, nonfinite

STEPS, BAD_FROM = 30, 20

class Log(nn.Module):
    "The log of the features: NaN once they turn negative."
    def forward(self, x): return x.log()

class Twice(nn.Module):
    "One `Linear` called twice per step."
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x): return self.lin(torch.relu(self.lin(x)))

def make_model(): return nn.Sequential(Log(), Twice(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

def train(db, run, steps=STEPS, bad_from=None, model=None, resume=False, seed=0):
    torch.manual_seed(seed)
    model = model or make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchEmber(model, run=run, db=db, resume=resume) as te:
        te.how_record_out(hist_stats(16))
        for step in range(steps):
            x = torch.rand(32, 8) + (0.1 if bad_from is None or step < bad_from else -0.5)
            (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
    return model

@pytest.fixture(scope='module')
def store(tmp_path_factory):
    "A store with a healthy run `good` and a run `bad` whose data turn negative under a `Log` at step 20."
    db = str(tmp_path_factory.mktemp('explore')/'store.db')
    train(db, 'good')
    train(db, 'bad', bad_from=BAD_FROM, seed=1)
    return db

@pytest.fixture
def ex(store):
    e = explore(store, run='good')
    yield e
    e.close()

def trace(fig, name): return next(t for t in fig.data if t.name == name)
def names(fig): return [t.name for t in fig.data]

# hist_stats

def test_hist_stats_edge_cases():
    f = hist_stats(4)
    h = f(torch.full((5,), 2.0))
    assert (h['hist_lo'], h['hist_hi']) == (1.5, 2.5) and h['hist'].tolist() == [0, 0, 5, 0]
    h = f(torch.tensor([float('nan'), float('inf')]))
    assert h['hist'].tolist() == [0.] * 4 and math.isnan(h['hist_lo'])
    assert f(torch.empty(0))['hist'] == [0.] * 4
    assert f(torch.arange(8))['hist'].tolist() == [2, 2, 2, 2]
    assert set(f(torch.empty(3, device='meta'))) == {'numel'}

# the data under the figures

def test_thin_and_combine(store):
    t = thin(list(range(100)), 7)
    assert len(t) == 7 and (t[0], t[-1]) == (0, 99) and set(np.diff(t)) <= {16, 17}
    assert thin([3, 5], 7) == [3, 5]
    r = load('good', store)
    raw = r.df(module='1.lin', ttype='output')
    assert sorted(raw['call'].unique()) == [0, 1]
    h = history(r, '1.lin', 'output')
    assert h['step'].tolist() == list(range(STEPS))
    assert (h['numel'] == 2 * 32 * 8).all()
    per = raw.groupby('step')
    np.testing.assert_allclose(h['min'], per['min'].min())
    np.testing.assert_allclose(h['max'], per['max'].max())
    np.testing.assert_allclose(h['mean'], per['mean'].mean())   # equal numel per call: the plain mean

def test_history_queries_only_the_steps_it_draws(store, monkeypatch):
    from torchember.query import Run
    calls, orig = [], Run.df
    def spy(self, **kw):
        calls.append(kw)
        return orig(self, **kw)
    monkeypatch.setattr(Run, 'df', spy)
    h = history(load('good', store), '2', 'output', max_points=7)
    assert len(h) == 7 and h['step'].iloc[0] == 0 and h['step'].iloc[-1] == STEPS - 1
    assert calls == [dict(module='2', ttype='output', tname=None, rank=None, step=h['step'].tolist())]

# the explorer

def test_run_picker(ex, store):
    assert [v for _, v in ex.run_picker.options] == ['bad', 'good']
    assert ex.run_picker.options[1][0] == f'good · Sequential · {STEPS} steps'
    assert ex.overlay_picker.value == ''
    assert re.fullmatch(rf'last updated \d\d:\d\d:\d\d · {STEPS} steps', ex.status.value)

def test_module_tree_and_filter(ex):
    values = [v for _, v in ex.module_picker.options]
    assert values == ['', '0', '1', '1.lin', '2', '3', '4']
    labels = dict((v, l) for l, v in ex.module_picker.options)
    assert labels['1.lin'].startswith('\u00a0' * 6) and labels['1.lin'].endswith('lin: Linear')
    ex.module_filter.value = 'LIN'
    assert [v for _, v in ex.module_picker.options] == ['', '1', '1.lin', '2', '4']
    ex.select('3')
    assert ex.module_filter.value == '' and ex.module_picker.value == '3'

def test_history_follows_selectors(ex, store):
    df = load('good', store).df(module='2', ttype='output')
    ex.module_picker.value = '2'
    assert ex.ttype_picker.value == 'output' and ex.tname_picker.value == 'output'
    mean = trace(ex.plots['history'], 'mean')
    assert list(mean.x) == df['step'].tolist() == list(range(STEPS))
    np.testing.assert_allclose(mean.y, df['mean'])
    np.testing.assert_allclose(trace(ex.plots['history'], 'mean ± std').y, df['mean'] + df['std'])
    np.testing.assert_allclose(trace(ex.plots['history'], 'min–max').y, df['max'])
    assert 'NaN/Inf' not in names(ex.plots['history'])

    ex.ttype_picker.value = 'weight_grad'
    assert ex.tname_picker.options == ('bias', 'weight') and ex.tname_picker.value == 'weight'
    g = load('good', store).df(module='2', ttype='weight_grad', tname='weight')
    np.testing.assert_allclose(trace(ex.plots['history'], 'mean').y, g['mean'])
    ex.tname_picker.value = 'bias'
    assert ex.history_df['tname'].unique().tolist() == ['bias']

    ex.stat_picker.value = ('norm', 'zero_frac')
    assert names(ex.plots['history']) == ['norm', 'zero_frac']
    b = load('good', store).df(module='2', ttype='weight_grad', tname='bias')
    np.testing.assert_allclose(trace(ex.plots['history'], 'norm').y, b['norm'])
    assert ex.plots['history'].yaxis.type == 'linear'
    ex.log_toggle.value = True
    assert ex.plots['history'].yaxis.type == 'log' and ex.plots['bars'].yaxis.type == 'log'

def test_heatmap(ex):
    ex.module_picker.value = '2'
    assert ex.plots['histogram'].shown
    hm = ex.plots['histogram'].data[0]
    assert hm.type == 'heatmap' and list(hm.x) == list(range(STEPS))
    np.testing.assert_allclose(np.nansum(np.array(hm.z, dtype=float), axis=0), 1)
    lo, hi = ex.history_df['hist_lo'].min(), ex.history_df['hist_hi'].max()
    assert lo < hm.y[0] < hm.y[-1] < hi
    ex.ttype_picker.value = 'weight'
    assert not ex.plots['histogram'].shown and len(ex.plots['histogram'].data) == 0

def test_overview_and_click(ex, store):
    r = load('good', store)
    bars = ex.plots['bars'].data[0]
    assert ex.ov_ttype.value == 'weight_grad' and ex.ov_stat.value == 'norm'
    assert list(bars.customdata) == ['1.lin', '2', '4']
    g = r.df(step=r.last_step, ttype='weight_grad', module='2')
    np.testing.assert_allclose(bars.y[1], math.sqrt((g['norm']**2).sum()))

    ex.ov_ttype.value = 'output'
    ex.ov_stat.value = 'std'
    bars = ex.plots['bars'].data[0]
    latest = r.df(step=r.last_step, ttype='output', module='3')
    assert list(bars.customdata) == ['', '0', '1', '1.lin', '2', '3', '4']
    np.testing.assert_allclose(bars.y[5], latest['std'].iloc[0])

    bars._dispatch_on_click(Points(point_inds=[5], xs=[bars.x[5]], ys=[bars.y[5]], trace_name=bars.name, trace_index=0),
                            InputDeviceState())
    assert ex.module_picker.value == '3'
    assert ex.history_df['module'].unique().tolist() == ['3']
    assert ex.plots['bars'].data[0].marker.line.width[5] == 2   # the selected bar is outlined

def test_nan_markers(ex, store):
    ex.run_picker.value = 'bad'
    ex.module_picker.value = '1.lin'
    df = load('bad', store).df(module='1.lin', ttype='output')
    bad = sorted(df.loc[df['nan_count'] > 0, 'step'].unique())
    assert bad == list(range(BAD_FROM, STEPS))
    marks = trace(ex.plots['history'], 'NaN/Inf')
    assert list(marks.x) == bad and np.isfinite(np.asarray(marks.y, dtype=float)).all()   # drawn, each at a height
    assert 'NaN/Inf' in names(ex.plots['histogram'])
    bars = ex.plots['bars'].data[0]                  # weight grads of the latest step are all NaN: the last finite step is shown
    assert all(y is not None and y > 0 for y in bars.y) and '#d62728' not in set(bars.marker.color)
    assert ex.plots['bars'].title.startswith(f'step {BAD_FROM - 1} (it. {BAD_FROM - 1}), the last before NaN/Inf (first at step {BAD_FROM}, it. {BAD_FROM}: 0 output)')

def test_overlay(ex, store):
    ex.module_picker.value = '2'
    before = names(ex.plots['history'])
    ex.overlay_picker.value = 'bad'
    after = names(ex.plots['history'])
    assert after[:len(before)] == before
    added = after[len(before):]
    assert added == [f'bad: {n}' for n in before] + ['bad: NaN/Inf']
    o = load('bad', store).df(module='2', ttype='output')
    ys = trace(ex.plots['history'], 'bad: mean').y
    np.testing.assert_allclose([np.nan if y is None else y for y in ys], o['mean'].astype(float))
    assert [t.name for t in ex.plots['bars'].data if t.type == 'bar'] == ['norm', 'bad: norm']
    ex.overlay_picker.value = ''
    assert names(ex.plots['history']) == before

def test_downsampled_explorer(store):
    e = explore(store, run='good', max_points=8)
    e.module_picker.value = '2'
    x = list(trace(e.plots['history'], 'mean').x)
    assert len(x) == 8 and x[0] == 0 and x[-1] == STEPS - 1
    assert list(e.plots['histogram'].data[0].x) == x
    e.close()

def test_live_mode_follows_new_steps(store, tmp_path):
    db = str(tmp_path/'live.db')
    model = train(db, 'live', steps=3)
    e = explore(db, interval=0.1)
    assert e.status.value.endswith(' 3 steps')
    e.live_toggle.value = True
    assert e._thread.is_alive()
    train(db, 'live', steps=4, model=model, resume=True)
    deadline = time.monotonic() + 30
    while not re.search(r' 7 steps', e.status.value) and time.monotonic() < deadline: time.sleep(0.05)
    assert re.fullmatch(r'last updated \d\d:\d\d:\d\d · 7 steps · live', e.status.value)
    assert len(trace(e.plots['history'], 'mean').x) == 7
    e.stop_button.click()
    e._thread.join(60)     # a poll under way ends first: seconds on a loaded machine; one that never stops still fails below
    assert not e._thread.is_alive() and e.live_toggle.value is False
    assert not e.status.value.endswith('live')
    e.close()

def test_poll_never_settles_behind(tmp_path, monkeypatch):
    "A step that closes while a poll reads is still new to the next poll."
    E = sys.modules['torchember.explore']     # the package's `explore` attribute is the function
    db = str(tmp_path/'race.db')
    model = train(db, 'race', steps=3)
    e = explore(db)
    assert e.poll() is False
    train(db, 'race', steps=1, model=model, resume=True)
    orig = E.recorded_steps
    def steps_then_one_more(run, after=None):
        res = orig(run, after)
        train(db, 'race', steps=1, model=model, resume=True)    # lands after the poll read the steps
        return res
    monkeypatch.setattr(E, 'recorded_steps', steps_then_one_more)
    assert e.poll() is True and len(e._steps) == 4
    monkeypatch.setattr(E, 'recorded_steps', orig)
    assert e.poll() is True and len(e._steps) == 5
    assert e.poll() is False and len(trace(e.plots['history'], 'mean').x) == 5
    e.close()

def test_redraw_updates_in_place(ex):
    "Same trace names and types: the figure's traces are updated, not replaced, so the browser does not flash empty."
    ex.module_picker.value = '2'
    uids = [t.uid for t in ex.plots['history'].data]
    y2 = list(trace(ex.plots['history'], 'mean').y)
    ex.module_picker.value = '4'
    assert [t.uid for t in ex.plots['history'].data] == uids
    assert list(trace(ex.plots['history'], 'mean').y) != y2
    np.testing.assert_allclose(trace(ex.plots['history'], 'mean').y, ex.history_df['mean'])

def test_te_explore(tmp_path):
    model = make_model()
    with torchEmber(model, run='te', db=str(tmp_path/'te.db')) as te:
        for _ in range(3): model(torch.rand(4, 8) + 0.1).sum().backward()
        e = te.explore()          # flushes: the open step is in the store
    assert e.run.name == 'te' and len(trace(e.plots['history'], 'mean').x) == 3
    e.close()

def test_empty_store_and_unknown_run(tmp_path):
    from torchember.store import engine
    engine(str(tmp_path/'empty.db'))                  # a store with no runs yet
    e = explore(str(tmp_path/'empty.db'))
    assert e.status.value == 'no runs in this store yet' and e.run is None
    e.close()
    with pytest.raises(KeyError, match="no run named 'nope'"): explore(str(tmp_path/'empty.db'), run='nope')

# the report

def test_report_html(store, tmp_path):
    p = report('bad', tmp_path/'out'/'bad.html', store)
    assert p == (tmp_path/'out'/'bad.html').resolve() and p.exists()
    page = p.read_text()
    assert not re.search(r'<script[^>]*\bsrc\s*=\s*["\']?(https?:)?//', page)
    assert not re.search(r'<script[^>]*\bsrc=', page)
    assert page.count('plotly.js v') == 1                     # plotly.js inlined once
    figs = page_figures(page)
    types = [t['type'] for traces, _ in figs for t in traces]
    assert {'bar', 'scatter', 'heatmap'} <= set(types)
    assert sum(t.get('name') == 'NaN/Inf' for traces, _ in figs for t in traces) >= 3
    assert any(t.get('name') == 'mean ± std' and t.get('fill') == 'tonexty' for traces, _ in figs for t in traces)
    bars = next(traces[0] for traces, _ in figs if traces[0]['type'] == 'bar')   # after the map and the scalars
    assert bars['customdata'] == ['1.lin', '2', '4']
    nf = nonfinite(load('bad', store))
    assert nf.iloc[0][['module', 'ttype', 'first_step']].tolist() == ['0', 'output', BAD_FROM]
    assert '<h2>NaN and Inf</h2>' in page and '<td>0</td>' in page

def test_report_paths(store, tmp_path):
    r = load('good', store)
    assert r.report(tmp_path/'a'/'b'/'r.html') == (tmp_path/'a'/'b'/'r.html').resolve()
    assert report('good', str(tmp_path/'dir') + '/', store).name == 'good.html'
    (tmp_path/'dir'/'link.html').symlink_to(tmp_path/'outside.html')
    with pytest.raises(ValueError, match='outside'): r.report(tmp_path/'dir'/'link.html')
    assert not (tmp_path/'outside.html').exists()

def test_cli(store, tmp_path):
    out = tmp_path/'cli'/'report.html'
    res = subprocess.run([sys.executable, '-m', 'torchember.cli', 'report', 'good', '--db', store, '-o', str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out.resolve()) and out.exists()
    res = subprocess.run([sys.executable, '-m', 'torchember.cli', 'report', 'nope', '--db', store],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and "no run named 'nope'" in res.stderr

def test_a_run_with_fewer_scalars_leaves_none_of_the_last_runs(tmp_path):
    "Switching from a run that logged three scalars to one that logged one: no trace of the first stays in the figure."
    db = str(tmp_path/'s.db')
    for run, names in (('many', ('loss', 'lr', 'acc')), ('few', ('loss',))):
        model = nn.Sequential(nn.Linear(3, 3))
        te = torchEmber(model, run=run, db=db)
        for i in range(4):
            model(torch.randn(2, 3)).sum().backward()
            te.log(**{n: float(i) for n in names})
        te.disarm()
    ex = Explorer(db, run='many')
    ex.run_picker.value = 'few'
    refs = {t.yaxis or 'y' for t in ex.fig.data}
    owned = set().union(*(p.refs for p in ex.plots.values()))
    assert refs <= owned, (refs - owned)
    assert not [t for t in ex.plots['scalars'].data if t.name in ('lr', 'acc')]
