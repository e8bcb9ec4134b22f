"""What a user sees and manages (issue 19): runs deleted and overwritten, the command line's errors and commands, the
training scalars, the overview on a blown-up run, the model-at-a-glance heatmap, and the report's layout."""
import json, re, subprocess, sys
from pathlib import Path
import numpy as np
import pytest, torch
import sqlalchemy as sa
from torch import nn
import torchember
from torchember import torchEmber, load, runs
from torchember.store import engine, metadata

def tiny(): return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def train(db, run, steps=5, blow_up_at=None, seed=0, **kw):
    "A tiny MLP trained `steps` steps with `loss` and `lr` logged; from step `blow_up_at` on its inputs hold a NaN."
    torch.manual_seed(seed)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchEmber(model, run=run, db=db, **kw) as te:
        for step in range(steps):
            x = torch.rand(16, 4)
            if blow_up_at is not None and step >= blow_up_at: x[0, 0] = float('nan')
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            te.log(loss=loss, lr=0.1)
    return model

def rows_of(db, run_id)->dict:
    "table -> rows of run `run_id`, for every table that has a run's rows."
    with engine(db).connect() as c:
        return {t.name: c.execute(sa.select(sa.func.count()).select_from(t).where((t.c.id if t.name == 'runs' else t.c.run_id) == run_id)).scalar()
                for t in metadata.sorted_tables if t.name == 'runs' or 'run_id' in t.c}

def cli(*args, cwd=None):
    return subprocess.run([sys.executable, '-m', 'torchember.cli', *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)

# A. runs you can manage

def test_delete_run_removes_every_row(db):
    train(db, 'keep'); train(db, 'gone', timing=True, snapshot='0.weight')
    gid, kid = load('gone', db).id, load('keep', db).id
    before, kept = rows_of(db, gid), rows_of(db, kid)
    assert before['stats'] and before['steps'] and before['scalars'] and before['calls'] and before['snapshots']
    gone = torchember.delete_run('gone', db)
    assert {k: v for k, v in gone.items() if v} == {k: v for k, v in before.items() if v}
    assert set(rows_of(db, gid).values()) == {0} and rows_of(db, kid) == kept
    assert runs(db)['name'].tolist() == ['keep']
    with pytest.raises(KeyError, match=r"no run named 'gone' in store .*; runs there: 'keep'"): torchember.delete_run('gone', db)

def test_delete_run_is_one_transaction(db, monkeypatch):
    "A delete that fails half way leaves every row where it was."
    train(db, 'x')
    rid = load('x', db).id
    before = rows_of(db, rid)
    import torchember.store as S
    orig = S.metadata.sorted_tables
    boom = sa.Table('boom', sa.MetaData(), sa.Column('run_id', sa.Integer))   # not in the store: its delete fails
    monkeypatch.setattr(type(S.metadata), 'sorted_tables', property(lambda self: [boom, *orig]))
    with pytest.raises(sa.exc.OperationalError): torchember.delete_run('x', db)
    monkeypatch.undo()
    assert rows_of(db, rid) == before

def test_overwrite_replaces_a_run(db):
    train(db, 'baseline', steps=4)
    with pytest.raises(ValueError, match='already exists'): train(db, 'baseline')
    train(db, 'baseline', steps=2, overwrite=True)
    r = load('baseline', db)
    assert r.n_steps == 2 and r.scalars()['step'].max() == 1 and rows_of(db, r.id)['steps'] == 2 and len(runs(db)) == 1
    with pytest.raises(ValueError, match='overwrite'): torchEmber(tiny(), run='baseline', db=db, overwrite=True, resume=True)

def test_explore_opens_the_newest_run_with_steps(db):
    train(db, 'trained')
    te = torchEmber(tiny(), run='armed-not-stepped', db=db)
    e = torchember.explore(db)
    assert runs(db)['name'].iloc[0] == 'armed-not-stepped' and e.run.name == 'trained'
    e.close(); te.disarm()

def test_cli_ls_and_rm(db):
    train(db, 'a'); train(db, 'b')
    res = cli('ls', '--db', db)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ['name', 'model', 'steps', 'last_step'] and [l.split()[0] for l in lines[1:]] == ['b', 'a']
    assert lines[1].split()[1:4] == ['Sequential', '5', '4']
    res = cli('rm', 'a', '--db', db)
    assert res.returncode == 0 and res.stdout.startswith("deleted run 'a'"), res.stderr
    assert runs(db)['name'].tolist() == ['b']

# B. the command line

@pytest.mark.parametrize('args, says', [
    (['report', 'b', '--db', '{tmp}/missing.db'], 'no torchember store'),
    (['report', 'nope', '--db', '{db}'], "no run named 'nope'"),
    (['rm', 'nope', '--db', '{db}'], "no run named 'nope'"),
    (['rm', '--db', '{db}'], "give the run's name"),
    (['ls', '--db', '{tmp}'], 'is a directory'),
    (['report', 'b', '--db', '{db}', '-o', '{db}/x.html'], 'torchember report: '),   # a file where a folder should be
    ([], 'give a command'),
])
def test_cli_errors_are_one_line_and_status_2(db, tmp_path, args, says):
    train(db, 'b', steps=2)
    res = cli(*[a.format(db=db, tmp=tmp_path) for a in args], cwd=tmp_path)
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and 'Traceback' not in res.stderr, res.stderr

def test_cli_bad_argument_and_version(db):
    res = cli('report', 'b', '--db', db, '--max-points', 'many')   # argparse's own: its usage, then the error's line
    assert res.returncode == 2 and 'Traceback' not in res.stderr
    assert re.fullmatch(r".*: error: argument --max-points: invalid int value: 'many'", res.stderr.strip().splitlines()[-1])
    res = cli('--version')
    assert res.returncode == 0 and res.stdout.strip() == f'torchember {torchember.__version__}'

def test_cli_report_rank_and_report_argument_order(db, tmp_path):
    train(db, 'r', steps=3)
    res = cli('report', 'r', '--db', db, '-o', tmp_path/'r.html', '--rank', 0)
    assert res.returncode == 0 and Path(res.stdout.strip()) == (tmp_path/'r.html').resolve(), res.stderr
    assert torchember.report('r', tmp_path/'p.html', db) == (tmp_path/'p.html').resolve()
    assert torchember.report('r', path=tmp_path/'q.html', db=db).exists()
    assert load('r', db).report(tmp_path/'s.html').exists()

def test_demo_says_how_to_look_at_its_run(tmp_path):
    res = subprocess.run([sys.executable, '-m', 'torchember.demo', '--steps', '3', '--db', tmp_path/'d.db', '--run', 'demo'],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    tail = res.stdout.strip().splitlines()[-2:]
    assert f"torchember report demo --db {tmp_path/'d.db'} -o report.html" in tail[0]
    assert f"torchember.explore({str(tmp_path/'d.db')!r})" in tail[1]
    assert load('demo', tmp_path/'d.db').scalars()['name'].unique().tolist() == ['loss', 'lr']

from test_postgres import server, pg   # a fresh PostgreSQL store, or a skip that says why there is none

def test_delete_and_overwrite_on_postgres(pg):
    train(pg, 'keep', steps=2); train(pg, 'gone', steps=2)
    gid = load('gone', pg).id
    assert torchember.delete_run('gone', pg)['stats'] > 0 and set(rows_of(pg, gid).values()) == {0}
    train(pg, 'keep', steps=3, overwrite=True)
    assert runs(pg)[['name', 'steps']].values.tolist() == [['keep', 3]]
    with pytest.raises(KeyError, match="no run named 'gone'"): torchember.delete_run('gone', pg)

# C. training scalars, the overview, no NaN in the widget's JSON

from plotly.callbacks import Points, InputDeviceState
from torchember.explore import explore
from torchember.figures import module_map, map_figure, scalars_figure

def click(trace, i=None, x=None, y=None):
    "What a click on point `i` of `trace` (or at `x`, `y` of a heatmap) sends from the browser."
    pts = Points(point_inds=[i] if i is not None else [[0, 0]], xs=[trace.x[i] if i is not None else x], ys=[trace.y[i] if i is not None else y],
                 trace_name=trace.name, trace_index=0)
    trace._dispatch_on_click(pts, InputDeviceState())

@pytest.fixture(scope='module')
def two(tmp_path_factory):
    "A store with a healthy run and one whose inputs hold a NaN from step 6 on (histograms recorded)."
    db = str(tmp_path_factory.mktemp('ui')/'store.db')
    train(db, 'ok', steps=10)
    train(db, 'nan', steps=10, blow_up_at=6, seed=1, hist=8)
    return db

def test_scalars_in_the_explorer_with_overlay(two):
    e = explore(two, run='ok')
    titles = [a.text for a in e.plots['scalars'].annotations]
    assert titles == ['loss', 'lr', 'grad_norm', 'weight_norm']
    st = load('ok', two).steps()
    loss = [t for t in e.plots['scalars'].data if t.name == 'ok' and t.xaxis == f"x{e.plots['scalars'].axes[0]}"][0]   # on its first subplot
    np.testing.assert_allclose(loss.y, st['loss']) and list(loss.x) == list(range(10))
    e.overlay_picker.value = 'nan'
    assert sorted({t.name for t in e.plots['scalars'].data}) == ['nan', 'ok'] and len(e.plots['scalars'].data) == 8
    assert {t.line.color for t in e.plots['scalars'].data if t.name == 'nan'} == {'#ff7f0e'}
    e.close()

def test_bar_click_keeps_ttype_and_stat(two):
    e = explore(two, run='ok')
    e.ov_ttype.value, e.ov_stat.value = 'weight_grad', 'norm'
    bars = e.plots['bars'].data[0]
    click(bars, 1)
    assert (e.module_picker.value, e.ttype_picker.value, e.stat_picker.value) == (bars.customdata[1], 'weight_grad', ('norm',))
    assert e.history_df['ttype'].unique().tolist() == ['weight_grad'] and [t.name for t in e.plots['history'].data] == ['norm']
    e.close()

def test_nan_never_reaches_the_widgets_json(two):
    "Every figure the explorer builds on a run that blew up is valid JSON (jupyter refuses NaN: 'Out of range float values')."
    e = explore(two, run='nan')
    def check(): json.dumps(e.fig.to_plotly_json(), allow_nan=False)   # the one figure holds every plot
    check()
    assert 'first NaN/Inf' in e.status.value and 'last before NaN/Inf (first at step 6' in e.plots['bars'].title
    for module in ('0', '2'):
        for tt in ('output', 'weight_grad', 'input'):
            e.select(module, tt, 'mean')
            check()
    e.ov_ttype.value = 'output'; e.ov_stat.value = 'max'; e.log_toggle.value = True
    e.overlay_picker.value = 'ok'
    check()
    e.close()

# D. the whole model at a glance

def test_map_click_opens_that_modules_history(two):
    e = explore(two, run='nan')
    assert e.children[2].children[0] is e.ov_ttype and e.children[3].children[1] is e.fig   # under the findings list
    assert e.plots['map'].yaxis.domain[1] == max(p.yaxis.domain[1] for p in e.plots.values())   # the map is on top
    hm = e.plots['map'].data[0]
    assert hm.type == 'heatmap' and list(hm.y) == ['\u00a0\u00a00 · Linear', '\u00a0\u00a02 · Linear'] and list(hm.x) == list(range(10))
    assert e.plots['map'].shapes[0].x0 == 5.5                                # the first NaN/Inf cell, step 6, outlined
    e.ov_stat.value = 'std'
    click(e.plots['map'].data[0], x=3, y=hm.y[1])
    assert (e.module_picker.value, e.ttype_picker.value, e.stat_picker.value) == ('2', 'weight_grad', ('std',))
    assert e.history_df['module'].unique().tolist() == ['2'] and [t.name for t in e.plots['history'].data] == ['std', 'NaN/Inf']
    assert e.plots['history'].shapes[0].x0 == 3 and 'step 3 marked' in e.plots['history'].title
    e.close()

def big_store(db, steps=10_000, n_modules=200):
    "A store with one run of `steps` steps of `n_modules` Linear layers, each with a weight grad every step, written directly."
    from torchember.store import create_run, write_step
    eng = engine(db)
    mods = [('', 'Sequential', None)] + [(str(i), 'Linear', 0) for i in range(n_modules)]
    tree = {'name': '', 'type': 'Sequential', 'children': [{'name': str(i), 'short': str(i), 'type': 'Linear', 'children': []} for i in range(n_modules)]}
    rid, _ = create_run(eng, 'big', 'Sequential', mods, tree)
    events = [('enter', 0, 0)] + [e for i in range(1, n_modules + 1) for e in (('enter', i, 0), ('exit', i, 0))] + [('exit', 0, 0)]
    write_step(eng, rid, 0, [], events)
    rng = np.random.default_rng(0)
    with eng.begin() as c:
        for lo in range(0, steps, 1000):
            st = range(lo, min(lo + 1000, steps))
            norms = rng.lognormal(size=(len(st), n_modules))
            cols = ('run_id, step, rank, module_id, call, ttype, tname, shape, dtype, numel, mean, std, min, max, norm, '
                    'zero_frac, nan_count, inf_count, extra, nbytes')   # named: the default stats may grow
            c.exec_driver_sql(f'INSERT INTO stats ({cols}) VALUES (' + ','.join('?' * 20) + ')',
                              [(rid, s, 0, m + 1, 0, 'weight_grad', 'weight', '[8, 8]', 'float32', 64, 0., 1., -1., 1., float(norms[k, m]), 0., 0, 0, None, 256)
                               for k, s in enumerate(st) for m in range(n_modules)])
            c.exec_driver_sql('INSERT INTO steps (run_id, step, rank, closed, n_records, events_step, training) VALUES (?,?,?,?,?,?,?)', [(rid, s, 0, 0., n_modules, 0, 1) for s in st if s])
    return load('big', db)

def test_map_of_a_long_run_queries_only_what_it_draws(db):
    import time
    r = big_store(db)
    seen = []
    def spy(conn, cursor, statement, *a): seen.append(statement)
    sa.event.listen(engine(db), 'before_cursor_execute', spy)
    t0 = time.perf_counter()
    m = module_map(r)
    f = map_figure(m, r)
    took = time.perf_counter() - t0
    sa.event.remove(engine(db), 'before_cursor_execute', spy)
    # a store written without rollups (as here) is read a step a column, marked sampled: one query, not every row
    (values,) = [q for q in seen if 'FROM stats' in q]
    assert {'module_id', 'step', 'norm', 'nan_count', 'inf_count'} <= set(re.findall(r'\b(module_id|step|norm|nan_count|inf_count)\b', values))
    named = re.search(r'step IN \(([^)]*)\)', values)
    assert named and len(named.group(1).split(',')) <= 520                  # at most ~500 steps named, not 10,000
    assert m['z'].shape[0] == 200 and m['z'].shape[1] <= 500 and len(f.data[0].y) == 200 and m['sampled'].all()
    col = 3
    np.testing.assert_allclose(m['z'][5, col], r.df(step=m['x'][col], module='5')['norm'].iloc[0])
    assert not m['bad'].any()
    print(f"\nmap of 10,000 steps x 200 modules: query + figure {took:.2f} s")

# E, F. the report

def test_report_layout(two, tmp_path):
    from torchember.report import page_figures
    page = torchember.report('nan', tmp_path/'r.html', two).read_text()
    figs = page_figures(page)
    assert any(a.get('dtick') == 1 for _, l in figs for k, a in l.items() if k.startswith('yaxis') and a.get('type') == 'log')
    assert figs[0][0][0]['type'] == 'heatmap' and figs[0][1]['shapes']                  # the map on top, first NaN outlined
    assert [a['text'] for a in figs[1][1]['annotations']] == ['loss', 'lr', 'grad_norm', 'weight_norm']
    for traces, layout in figs:
        axes = {k: v for k, v in layout.items() if re.fullmatch(r'[xy]axis\d*', k)}
        assert all(a.get('dtick', 1) == 1 for a in axes.values() if a.get('type') == 'log'), axes   # powers of ten, or plotly's within a decade
        xs = [a for k, a in axes.items() if k.startswith('x') and a.get('visible', True)]   # the graph's are hidden
        assert all(a.get('title', {}).get('text') == 'step' for a in xs), xs
    assert page.count('plotly.js v') == 1 and not re.search(r'<script[^>]*\bsrc=', page)   # one copy, inlined: works offline
    assert re.search(r'<td>0</td>\s*<td>output</td>\s*<td>output</td>\s*<td>6</td>\s*<td>4</td>\s*<td>\d+</td>', page)  # integer counts
    assert '.0</td>' not in page.split('<h2>NaN and Inf</h2>')[1].split('</table>')[0]
    assert '(Linear) output at step 6' in page and 'output output' not in page
    opened, rest = page.split('<details>')
    assert '(first NaN/Inf)' in opened and 'more figures of the other modules' in rest
    print(f"\nreport of a 10-step 3-module run: {len(page) / 2**20:.2f} MiB")
