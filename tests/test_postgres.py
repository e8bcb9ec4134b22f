"""A PostgreSQL store (issue "Scale-out"): `db="postgresql+psycopg://…"` works unchanged.

The library creates the same schema there; training writes it, the query layer, the views, the explorer and the report
read it, and what they read equals what the same training gives in SQLite. Each test gets a fresh database on the
server named by `$TORCHEMBER_PG_URL` (`bash .ci/test` starts a throwaway one with `.ci/postgres`); without one the
tests skip and say why.
"""
import os, subprocess, sys, textwrap, uuid
import pandas as pd
import pytest, torch
import sqlalchemy as sa
from pandas.testing import assert_frame_equal
from torch import nn

from torchember import torchEmber, record_tensor, load, runs, explore
from torchember.report import report, page_figures, nonfinite
from torchember.store import StoreError, engine, create_run, write_step, _engines, _lost_race

PG_URL = os.environ.get('TORCHEMBER_PG_URL')

@pytest.fixture(scope='module')
def server():
    "An AUTOCOMMIT engine on the server's maintenance database, or a skip that says why there is none."
    if not PG_URL: pytest.skip("no PostgreSQL server: set TORCHEMBER_PG_URL to one's URL (bash .ci/test starts one with .ci/postgres)")
    pytest.importorskip('psycopg', reason="psycopg is not installed: pip install 'torchember[postgres]'")
    eng = sa.create_engine(PG_URL, isolation_level='AUTOCOMMIT', poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c: c.exec_driver_sql('SELECT 1')
    except sa.exc.OperationalError as e:
        pytest.skip(f"the PostgreSQL server of TORCHEMBER_PG_URL is unreachable: {str(e.orig).strip()[:300]}")
    yield eng
    eng.dispose()

def forget(url):
    "Close torchember's engine on `url`, so the store is opened afresh (or its database can be dropped)."
    eng = _engines.pop(url, None)
    if eng is not None: eng.dispose()

def new_database(server)->str:
    "A new, empty database; its URL. It collates by a natural language where the server can (as most servers do)."
    name = f'te_{uuid.uuid4().hex[:12]}'
    with server.connect() as c:
        try: c.exec_driver_sql(f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US'")
        except sa.exc.DBAPIError: c.exec_driver_sql(f'CREATE DATABASE {name}')
    return server.url.set(database=name).render_as_string(hide_password=False)

def drop_database(server, url):
    forget(url)
    with server.connect() as c: c.exec_driver_sql(f'DROP DATABASE IF EXISTS {sa.make_url(url).database} WITH (FORCE)')

@pytest.fixture
def pg(server):
    "A fresh torchember store in a new PostgreSQL database, dropped after the test; its URL."
    url = new_database(server)
    yield url
    drop_database(server, url)

def sql(url, q, **params):
    with engine(url).connect() as c: return [tuple(r) for r in c.execute(sa.text(q), params)]


# ---------------------------------------------------------------- a real model, trained into both stores

class Attend(nn.Module):
    "Attaches tensors whose names sort differently by bytes ('Q' < 'a_c' < 'ab' < 'k') and by a natural language."
    def forward(self, x):
        for name in ('k', 'ab', 'Q', 'a_c'): record_tensor(x * len(name), self, name)
        return x

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), Attend(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))

STEPS, BAD_AT = 5, 4

def train(db, run='cnn', steps=STEPS, bad_at=BAD_AT):
    "Train `make_model` for `steps` steps with everything recorded; the input of step `bad_at` holds a NaN."
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with torchEmber(model, run=run, db=db, timing=True, hist=8, snapshot='*.weight', strict=True) as te:
        for step in range(steps):
            x = torch.randn(2, 3, 8, 8, generator=g)
            if step == bad_at: x[0, 0, 0, 0] = float('nan')
            loss = model(x).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            te.log(Loss=loss, acc=0.5, a_c=1.0)
    return model

@pytest.fixture(scope='module')
def both(server, tmp_path_factory):
    "The same training recorded into a fresh PostgreSQL database and into a SQLite file: their URLs."
    url, lite = new_database(server), str(tmp_path_factory.mktemp('pg')/'store.db')
    train(url); train(lite)
    yield url, lite
    drop_database(server, url)

def test_schema_is_the_library_s(both):
    url, lite = both
    insp = sa.inspect(engine(url))
    assert set(insp.get_table_names()) == set(sa.inspect(engine(lite)).get_table_names())
    assert set(insp.get_view_names()) == {'records', 'latest', 'sequences'}
    assert sql(url, "SELECT value FROM meta WHERE key = 'schema_version'") == [('3',)]
    types = {c['name']: str(c['type']) for c in insp.get_columns('stats')}
    assert types['nbytes'] == 'BIGINT' and types['mean'] == 'DOUBLE PRECISION'
    assert sql(url, "SELECT count(*) FROM latest") == sql(lite, "SELECT count(*) FROM latest")

def test_records_equal_sqlite(both):
    url, lite = both
    pg, sl = load('cnn', url), load('cnn', lite)
    assert repr(pg).startswith("Run('cnn', model=Sequential, steps=5, last_step=4")
    df = pg.df()
    assert len(df) and {'hist', 'hist_lo'} <= set(df.columns)               # the `extra` JSON spread into columns
    assert_frame_equal(df, sl.df(), check_dtype=False)
    assert df[(df.module == '3') & (df.step == 0)]['tname'].tolist() == ['Q', 'a_c', 'ab', 'k', 'x', 'output']
    assert_frame_equal(pg.latest(), sl.latest(), check_dtype=False)
    assert set(pg.latest()['step']) == {STEPS - 1}
    assert_frame_equal(pg.df(module=['1', '5'], ttype='weight_grad', steps=(1, 3)),
                       sl.df(module=['1', '5'], ttype='weight_grad', steps=(1, 3)), check_dtype=False)
    assert pg.tree() == sl.tree()
    assert pg.sequence() == sl.sequence() == pg.sequence(0)
    assert pg.sequence()[:3] == ['enter ', 'enter 0', 'exit 0']
    assert_frame_equal(pg.modules(), sl.modules(), check_dtype=False)

def test_views_equal_sqlite(both):
    url, lite = both
    for q in ("SELECT run, step, module, ttype, tname, call, mean, nan_count FROM latest ORDER BY module_id, call, ttype, tname",
              "SELECT run, step, seq, kind, module, call FROM sequences ORDER BY step, seq",
              "SELECT count(*), count(DISTINCT step), max(step) FROM records"):
        a, b = sql(url, q), sql(lite, q)
        assert len(a) == len(b) and len(a)
        assert pd.DataFrame(a).fillna(-1).equals(pd.DataFrame(b).fillna(-1))   # NaN there, NULL in SQLite

def test_runs_steps_calls_scalars_equal_sqlite(both):
    url, lite = both
    pg, sl = load('cnn', url), load('cnn', lite)
    mine = ['name', 'model', 'steps', 'last_step', 'user', 'host', 'torch']
    assert_frame_equal(runs(url)[mine], runs(lite)[mine])
    st = pg.steps()
    assert st.columns.tolist() == ['step', 'rank', 'iteration', 'kind', 'closed', 'training', 'n_records', 'grad_norm', 'weight_norm', 'Loss', 'a_c', 'acc']
    assert_frame_equal(st.drop(columns='closed'), sl.steps().drop(columns='closed'), check_dtype=False)
    assert st['grad_norm'].iloc[:BAD_AT].notna().all() and st['grad_norm'].isna().iloc[BAD_AT]
    assert_frame_equal(pg.scalars(), sl.scalars(), check_dtype=False)
    calls, ref = pg.calls(), sl.calls()
    assert len(calls) == STEPS * 7 and calls['training'].all() and (calls['fwd_ms'] >= 0).all()
    same = ['run', 'step', 'module', 'mtype', 'call', 'training']                # the times themselves differ
    assert_frame_equal(calls[same], ref[same], check_dtype=False)
    assert (calls['bwd_ms'].isna() == ref['bwd_ms'].isna()).all()

def test_snapshots_nonfinite_summary_equal_sqlite(both):
    url, lite = both
    pg, sl = load('cnn', url), load('cnn', lite)
    assert_frame_equal(pg.snapshots(), sl.snapshots(), check_dtype=False)
    assert set(pg.snapshots()['module']) == {'0', '1', '5'}
    for step in range(STEPS):
        w = pg.snapshot('5', 'weight', step=step)
        assert w.shape == (2, 144) and torch.equal(w, sl.snapshot('5', 'weight', step=step))
    first = pg.first_nonfinite()
    assert first == sl.first_nonfinite()
    assert (first['step'], first['module'], first['ttype']) == (BAD_AT, '0', 'output')
    assert_frame_equal(pg.summary(), sl.summary(), check_dtype=False)
    assert_frame_equal(pg.summary(step=0), sl.summary(step=0), check_dtype=False)
    assert untimed(pg.to_json()) == untimed(sl.to_json())
    assert_frame_equal(nonfinite(pg), nonfinite(sl), check_dtype=False)

def untimed(tree:dict)->dict:
    "`Run.to_json`'s tree without the call times, which differ from run to run."
    return {k: {'info': {i: v for i, v in n['info'].items() if not i.endswith('_ms')}, 'children': untimed(n['children'])}
            for k, n in tree.items()}

def test_explorer_and_report(both, tmp_path):
    url, _ = both
    e = explore(url, run='cnn')
    try:
        assert e.run.name == 'cnn' and e.status.value.endswith(f' {STEPS} steps · first NaN/Inf: 0 (Conv2d) output at step {BAD_AT} (it. {BAD_AT})')
        e.module_picker.value = '2'
        mean = next(t for t in e.plots['history'].data if t.name == 'mean')
        assert list(mean.x) == list(range(STEPS))
        assert len(e.plots['bars'].data) and len(e.plots['histogram'].data)
        assert 'NaN/Inf' in [t.name for t in e.plots['history'].data]
    finally: e.close()
    p = report('cnn', tmp_path/'cnn.html', url)
    figs = page_figures(p.read_text())
    assert {'bar', 'scatter', 'heatmap'} <= {t['type'] for traces, _ in figs for t in traces}
    assert '<h2>NaN and Inf</h2>' in p.read_text()


# ---------------------------------------------------------------- writing: late rows, other processes, refusals

def test_late_rows_replace_as_in_sqlite(pg, tmp_path):
    "Rows written again for a step (grads after a flush, a repeated snapshot) replace the first ones, as in SQLite."
    def row(mean): return (1, 0, 'output', 'output', '[2]', 'float32', 2, mean, 0., 0., 1., 1., 0., 0, 0, None, 8)
    got = []
    for db in (pg, str(tmp_path/'store.db')):
        eng = engine(db)
        rid, _ = create_run(eng, 'late', 'Sequential', [('', 'Sequential', None), ('0', 'Linear', 0)], {'name': ''})
        write_step(eng, rid, 0, [row(0.5)], [('enter', 0, 0), ('exit', 0, 0)], calls=[(1, 0, True, 1.0, None)],
                   scalars={'loss': 1.0}, snapshots=[(1, 'weight', 'weight', 0, 'float32', '[1]', b'x')])
        write_step(eng, rid, 0, [row(2.5)], closed=False, calls=[(1, 0, True, 1.0, 3.0)], scalars={'loss': 2.0},
                   snapshots=[(1, 'weight', 'weight', 0, 'float32', '[1]', b'y')])
        got.append([sql(db, q) for q in ("SELECT step, mean FROM records", "SELECT training, fwd_ms, bwd_ms FROM calls",
                                         "SELECT name, value FROM scalars", "SELECT data FROM snapshots")])
    assert got[0] == got[1] == [[(0, 2.5)], [(1, 1.0, 3.0)], [('loss', 2.0)], [(b'y',)]]

TRAIN = textwrap.dedent('''
    import sys
    import torch
    from torch import nn
    from torchember import torchEmber
    db, run, width = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    print('ready', flush=True)
    sys.stdin.readline()
    with torchEmber(model, run=run, db=db, strict=True) as te:
        for step in range(40):
            model(torch.randn(16, width)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
            if step % 10 == 9: te.flush()
    print('done', flush=True)
''')

def test_two_processes_write_two_runs_into_one_database(pg, tmp_path):
    "Two training processes started together on a new database: both create the schema, both runs are complete."
    script = tmp_path/'train.py'
    script.write_text(TRAIN)
    ps = {name: subprocess.Popen([sys.executable, str(script), pg, name, str(w)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={**os.environ, 'TORCHEMBER_COMPILE': '0'})
          for name, w in (('narrow', 4), ('wide', 16))}
    for p in ps.values(): assert p.stdout.readline().strip() == 'ready'
    for p in ps.values(): p.stdin.write('go\n'); p.stdin.flush()
    for p in ps.values():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == 'done', err[-3000:]
    assert sorted(runs(pg)['name']) == ['narrow', 'wide']
    for name, w in (('narrow', 4), ('wide', 16)):
        r = load(name, pg)
        st = r.steps()
        assert st['step'].tolist() == list(range(40)) and (st['n_records'] == 16).all()
        df = r.df()
        assert len(df) == 40 * 16 and set(df[(df.module == '0') & (df.tname == 'weight')]['shape']) == {(w, w)}

RACE = textwrap.dedent('''
    import sys
    from torchember.store import engine
    print('ready', flush=True)
    for line in sys.stdin:
        try: engine(line.strip()); print('ok', flush=True)
        except Exception as e: print('ERR', type(e).__name__, str(e).replace(chr(10), ' ')[:300], flush=True)
''')

def test_concurrent_first_open_of_a_fresh_database(server, tmp_path):
    "Fresh databases, each opened by two processes at the same moment: both get a working store."
    script = tmp_path/'race.py'
    script.write_text(RACE)
    urls = [new_database(server) for _ in range(4)]
    ps = [subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in ps: assert p.stdout.readline().strip() == 'ready'
        errors = []
        for url in urls:
            for p in ps: p.stdin.write(url + '\n'); p.stdin.flush()
            errors += [line for p in ps if (line := p.stdout.readline().strip()) != 'ok']
    finally:
        for p in ps: p.stdin.close(); p.wait(timeout=60)
    try:
        assert not errors, errors[:3]
        for url in urls: assert sql(url, "SELECT value FROM meta") == [('3',)] and len(sql(url, "SELECT * FROM latest")) == 0
    finally:
        for url in urls: drop_database(server, url)

def test_lost_race_is_recognised(pg):
    "What PostgreSQL says when another process created a table first is a race `engine` retries, not a failure."
    engine(pg)
    with pytest.raises(sa.exc.ProgrammingError) as e:
        with engine(pg).begin() as c: c.exec_driver_sql('CREATE TABLE meta (key VARCHAR)')
    assert _lost_race(e.value.orig)
    with pytest.raises(sa.exc.ProgrammingError) as e:
        with engine(pg).begin() as c: c.exec_driver_sql('SELECT no_such_column FROM meta')
    assert not _lost_race(e.value.orig)

def test_duplicate_run_name_refused(pg):
    model = make_model()
    torchEmber(model, run='once', db=pg).disarm()
    with pytest.raises(ValueError, match="a run named 'once' already exists"): torchEmber(make_model(), run='once', db=pg)
    te = torchEmber(model, run='once', db=pg, resume=True)
    model(torch.randn(1, 3, 8, 8)).sum().backward()
    te.disarm()
    assert load('once', pg).n_steps == 1

def test_newer_schema_and_foreign_database_refused(pg, server):
    engine(pg)
    sql_exec(pg, "UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    forget(pg)
    with pytest.raises(StoreError, match="schema version 99, newer than this torchember's 3"): engine(pg)
    with pytest.raises(StoreError, match="schema version 99"): load('x', pg)
    other = new_database(server)
    try:
        with sa.create_engine(other, poolclass=sa.pool.NullPool).begin() as c: c.exec_driver_sql('CREATE TABLE invoices (id INTEGER)')
        with pytest.raises(StoreError, match="is a database but not a torchember store"): engine(other)
    finally: drop_database(server, other)
    missing = server.url.set(database='te_no_such_database').render_as_string(hide_password=False)
    with pytest.raises(StoreError, match="not a usable torchember store"): engine(missing)

def sql_exec(url, q):
    with engine(url).begin() as c: c.exec_driver_sql(q)

def test_version_1_store_upgraded_in_place(pg):
    "A store from before schema version 2 (no `nbytes`, no `calls`) gets the columns, tables and views it lacks."
    model = make_model()
    with torchEmber(model, run='old', db=pg):
        model(torch.randn(1, 3, 8, 8)).sum().backward()
    for q in ('DROP VIEW latest', 'DROP VIEW records', 'DROP VIEW sequences', 'ALTER TABLE stats DROP COLUMN nbytes',
              'DROP TABLE calls', "UPDATE meta SET value = '1' WHERE key = 'schema_version'"): sql_exec(pg, q)
    forget(pg)
    r = load('old', pg)
    assert sql(pg, "SELECT value FROM meta") == [('3',)]
    assert {c['name'] for c in sa.inspect(engine(pg)).get_columns('stats')} >= {'nbytes'}
    assert 'calls' in sa.inspect(engine(pg)).get_table_names()
    assert len(r.latest()) and 'nbytes' not in r.df().columns      # old rows read back, without the sizes they never had
    assert sql(pg, "SELECT count(*) FROM latest") == [(len(r.df()),)]


# ---------------------------------------------------------------- a sharded job: ranks merge their pieces in turn

def test_sharded_pieces_merge_in_postgresql(pg, tmp_path):
    "Two ranks writing their pieces concurrently: the last to close a step writes the whole parameters (advisory lock)."
    pytest.importorskip('torch.distributed.fsdp')
    from test_sharded import run_job, check_whole
    res = run_job(pg, tmp_path/'result', ('fsdp2', 'fsdp1', 'hsdp'))
    for setup in ('fsdp2', 'fsdp1', 'hsdp'): check_whole(pg, res, setup)

# ---------------------------------------------------------------- a long run: rollups and thinning

def test_long_runs_keep_their_extremes_in_postgresql(pg):
    "The heatmap of 6,000 steps reads the rollups PostgreSQL folded: the spike's column is brightest, the NaN's red, and thinning keeps them."
    import numpy as np
    from pathlib import Path
    from torchember.figures import module_map, module_envelope
    sys.path.insert(0, str(Path(__file__).parent.parent/'bench'))
    from big import build
    spike, nan = build(pg, modules=21, steps=6000, record=30, name='long')
    run = load('long', pg)
    names = {m: i for i, m in enumerate(run.modules()['module'])}
    m = module_map(run, ttype='weight_grad', stat='norm')
    col = lambda k: next(j for j, x in enumerate(m['x']) if x <= k < x + m['width'])
    assert m['width'] > 8 and np.nanargmax(m['z'][m['modules'].index('2')]) == col(spike)
    out = module_map(run, ttype='output', stat='mean')
    assert [tuple(b) for b in np.argwhere(out['bad'])] == [(out['modules'].index('4'), col(nan))]
    assert module_envelope(run, '4', 'output')['bad_step'].dropna().tolist() == [nan]
    run.thin(every=100)
    np.testing.assert_array_equal(module_map(run, ttype='weight_grad', stat='norm')['z'], m['z'])


def test_postgresql_folds_from_memory_only_the_bins_without_nan(pg, monkeypatch):
    "On PostgreSQL the writer folds from memory a bin whose rows hold no NaN; the server folds the others (NaN is a value there)."
    from test_known_folds import check_folds
    t = check_folds(pg, 1, monkeypatch, from_memory=None)   # and the rollups equal those the server folds from the rows
    assert True in t._took and False in t._took, t._took

def test_store_made_before_absmax_reads_it_without_rewriting_a_row(pg):
    "A schema-2 store (no `absmax`, views that lack it) gains the column at once; reads fill it in from min and max."
    from torchember.store import VIEWS, _stat_sql
    model = make_model()
    with torchEmber(model, run='old', db=pg):
        model(torch.randn(1, 3, 8, 8) - 3).sum().backward()
    old = [f"CREATE VIEW {k} AS {q.replace(', ' + _stat_sql('absmax'), '')}" for k, q in VIEWS.items()]
    for q in ('DROP VIEW latest', 'DROP VIEW records', 'DROP VIEW sequences', 'ALTER TABLE stats DROP COLUMN absmax',
              'ALTER TABLE shards DROP COLUMN absmax', *old, "UPDATE meta SET value = '2' WHERE key = 'schema_version'"):
        sql_exec(pg, q)
    forget(pg)
    df = load('old', pg).df()   # `latest` reads `records`: they are dropped in that order, and made anew
    assert len(df) and df['absmax'].notna().all()
    assert (df['absmax'] == df[['min', 'max']].abs().max(axis=1)).all()
    assert sql(pg, "SELECT value FROM meta") == [('3',)]
    assert sql(pg, "SELECT COUNT(*) FROM stats WHERE absmax IS NOT NULL") == [(0,)]   # no row rewritten
    view = sql(pg, "SELECT absmax, min, max FROM latest")
    assert view and all(a == max(abs(lo), abs(hi)) for a, lo, hi in view)
