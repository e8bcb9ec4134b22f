"""Data-parallel training (issue "Scale-out"): the ranks of a `DistributedDataParallel` job record one run.

Two real processes train a small model on the CPU (the gloo backend, on the loopback interface only), each on its own
share of the data; every test reads what they wrote. Their records carry their rank, the modules are named as the
plain model's, and the grads recorded are those the optimizer steps with: the same on both ranks after DDP averages
them, a rank's own under `no_sync`. Both ranks write one SQLite file at once; the same job recorded into PostgreSQL
(with `$TORCHEMBER_PG_URL`, as in `tests/test_postgres.py`) reads back equal.
"""
import json, os, socket, subprocess, sys, textwrap
import pytest, torch
import sqlalchemy as sa
from pandas.testing import assert_frame_equal

from torchember import load, runs
from torchember.store import engine, keyed_by_rank, StoreError

WORKER = textwrap.dedent('''
    import contextlib, json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchember import torchEmber

    db, out, only = sys.argv[1], sys.argv[2], sys.argv[3].split(',')
    dist.init_process_group('gloo')                      # rank, world size, address from the environment
    rank = dist.get_rank()

    def train(run, steps=4, accumulate=False, **kw):
        "Train a fresh model for `steps` steps; each step's grad norms as `.grad` held them after its backward."
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
        ddp = DDP(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)     # each rank its own data
        norms = []
        te = torchEmber(ddp, run=run, db=db, strict=True, **kw)
        for step in range(steps):
            local = accumulate and step % 2 == 0          # accumulate locally, all-reduce on the next backward
            with ddp.no_sync() if local else contextlib.nullcontext():
                loss = ddp(torch.randn(4, 6, generator=g)).pow(2).mean()
                loss.backward()
            norms.append({n: p.grad.norm().item() for n, p in net.named_parameters()})
            te.log(loss=loss)
            if not local: opt.step(); opt.zero_grad()
        te.disarm()
        return te.run_name, norms

    res = {}
    if 'ddp' in only: res['ddp'] = train('ddp')
    if 'accum' in only: res['accum'] = train('accum', accumulate=True)
    if 'rank0' in only: res['rank0'] = train('rank0', steps=3, ranks=[0])
    if 'default' in only: res['default'] = train(None, steps=2)
    with open(f'{out}.{rank}.json', 'w') as f: json.dump(res, f)
    dist.barrier()                                      # neither rank tears gloo down while the other still talks
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)      # gloo's threads can abort a finishing interpreter now and then (SIGABRT, torch's, not ours)
''')

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def job(tmp, db, runs=('ddp', 'accum', 'rank0', 'default'), world=2)->list:
    "Run WORKER as `world` processes of one job recording into `db`; each rank's results."
    script, out = tmp/'worker.py', tmp/'result'
    script.write_text(WORKER)
    env = {**os.environ, 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(free_port()), 'WORLD_SIZE': str(world),
           'TORCHEMBER_COMPILE': '0', 'OMP_NUM_THREADS': '1'}
    if sys.platform == 'linux': env.setdefault('GLOO_SOCKET_IFNAME', 'lo')
    ps = [subprocess.Popen([sys.executable, str(script), db, str(out), ','.join(runs)], env={**env, 'RANK': str(r)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    failed = []                                          # every rank's failure: one rank's error can abort the others in gloo
    try:
        for r, p in enumerate(ps):
            _, err = p.communicate(timeout=300)         # a job takes ~30 s beside 6 busy processes on 2 cores
            if p.returncode: failed.append(f'rank {r} exited with {p.returncode}:\n{err[-3000:]}')
    finally:
        for p in ps:
            if p.poll() is None: p.kill()
    assert not failed, '\n'.join(failed)
    return [json.loads((tmp/f'result.{r}.json').read_text()) for r in range(world)]

@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    "One two-rank job that records its runs into a fresh SQLite store: the store and each rank's results."
    tmp = tmp_path_factory.mktemp('ddp')
    db = str(tmp/'store.db')
    return db, job(tmp, db)

def grads(run, rank):
    "`{step: {'module.tname': norm}}` of the weight grads `rank` recorded."
    df = run.df(ttype='weight_grad', rank=rank)
    return {s: {f'{m}.{t}': n for m, t, n in zip(d['module'], d['tname'], d['norm'])} for s, d in df.groupby('step')}

def close(a:dict, b:dict):
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * max(1., abs(b[k])) for k in a)


def test_both_ranks_record_one_run(trained):
    db, res = trained
    assert sorted(runs(db)['name'])[:3] == ['accum', 'ddp', 'rank0'] and len(runs(db)) == 4   # one run per job, not per rank
    r = load('ddp', db)
    df = r.df()
    assert (r.ranks, r.world_size) == ([0, 1], 2)
    assert sorted(df['rank'].unique()) == [0, 1]
    assert sorted(df['module'].unique()) == ['', '0', '1', '2']               # the inner model's names: no 'module.'
    by_rank = {k: d.drop(columns='rank').reset_index(drop=True) for k, d in df.groupby('rank')}
    assert by_rank[0]['step'].tolist() == by_rank[1]['step'].tolist() and sorted(set(by_rank[0]['step'])) == [0, 1, 2, 3]
    key = ['step', 'module', 'ttype', 'tname']
    assert by_rank[0][key].equals(by_rank[1][key])                             # the same records on both ranks
    out = df[df.ttype == 'input'].groupby('rank')['mean'].apply(list)
    assert out[0] != out[1]                                                    # of different data
    st = r.steps()
    assert st[['step', 'rank']].values.tolist() == [[s, k] for s in range(4) for k in (0, 1)]
    assert (st.groupby('step')['n_records'].nunique() == 1).all()
    assert r.scalars()['rank'].tolist() == [0, 1] * 4

def test_grads_recorded_after_the_all_reduce(trained):
    db, res = trained
    r = load('ddp', db)
    g0, g1 = grads(r, 0), grads(r, 1)
    assert g0 == g1                                                            # DDP averaged them: equal, bit for bit
    for rank, g in ((0, g0), (1, g1)):
        expected = {s: d for s, d in enumerate(res[rank]['ddp'][1])}
        assert all(close(g[s], expected[s]) for s in expected), (g, expected)
    w = r.df(ttype='weight')
    assert w[w['rank'] == 0]['norm'].tolist() == w[w['rank'] == 1]['norm'].tolist()   # so the weights stay equal too

def test_no_sync_accumulation(trained):
    "Under no_sync a backward's grads are the rank's own; the next backward averages the accumulated ones."
    db, res = trained
    r = load('accum', db)
    g0, g1 = grads(r, 0), grads(r, 1)
    assert sorted(g0) == sorted(g1) == [0, 1, 2, 3]
    for step in (0, 2): assert g0[step] != g1[step]                             # local, not yet reduced
    for step in (1, 3): assert g0[step] == g1[step]                             # accumulated, then averaged
    for rank, g in ((0, g0), (1, g1)):
        assert all(close(g[s], d) for s, d in enumerate(res[rank]['accum'][1]))

def test_ranks_0_records_only_rank_0(trained):
    db, res = trained
    r = load('rank0', db)
    assert r.df()['rank'].unique().tolist() == [0] and (r.ranks, r.world_size, r.n_steps) == ([0], 2, 3)
    assert res[1]['rank0'][0] == 'rank0'
    with engine(db).connect() as c:
        assert c.exec_driver_sql("SELECT rank FROM ranks JOIN runs ON runs.id = ranks.run_id WHERE name = 'rank0'").all() == [(0,)]

def test_default_run_name_is_agreed(trained):
    db, res = trained
    name = res[0]['default'][0]
    assert name == res[1]['default'][0] and name.startswith('sequential-')
    assert load(name, db).ranks == [0, 1]

def test_latest_and_views_with_two_ranks(trained):
    db, _ = trained
    r = load('ddp', db)
    assert (r.last_steps, r.last_step) == ({0: 3, 1: 3}, 3)
    lt = r.latest()
    assert set(lt['step']) == {3} and sorted(lt['rank'].unique()) == [0, 1]
    assert len(r.latest(rank=1)) == len(lt) // 2
    assert r.sequence(rank=0) == r.sequence(rank=1) and r.sequence()[:2] == ['enter ', 'enter 0']
    with engine(db).connect() as c:
        assert c.exec_driver_sql("SELECT count(*) FROM latest WHERE run = 'ddp'").scalar() == len(lt)
        assert c.exec_driver_sql("SELECT count(DISTINCT rank) FROM sequences WHERE run = 'ddp'").scalar() == 2
    assert r.summary()['module'].tolist() == ['(root)', '0', '1', '2']        # one rank's view (the first's)

def test_explorer_and_report_show_the_ranks(trained, tmp_path):
    from torchember import explore
    from torchember.report import report
    db, _ = trained
    e = explore(db, run='ddp')
    try:
        assert e.rank_picker.layout.display is None and [v for _, v in e.rank_picker.options] == [0, 1, 'all', 'spread']
        assert e.status.value.endswith(' · 4 steps · 2 ranks')
        e.module_picker.value = '0'
        e.ttype_picker.value = 'weight_grad'
        e.rank_picker.value = 'spread'
        band = {t.name: list(t.y) for t in e.plots['history'].data}
        assert band['mean: lowest rank'] == band['mean: range over ranks']        # averaged grads: no spread at all
        e.ttype_picker.value = 'input'
        band = {t.name: list(t.y) for t in e.plots['history'].data}
        assert all(lo < hi for lo, hi in zip(band['mean: lowest rank'], band['mean: range over ranks']))   # each rank its data
        e.rank_picker.value = 'all'
        assert [t.name for t in e.plots['bars'].data if t.type == 'bar'] == ['rank 0: norm', 'rank 1: norm']
    finally: e.close()
    assert 'figures of rank 0' in report('ddp', tmp_path/'ddp.html', db).read_text()

def test_a_second_job_of_the_same_name_is_refused(trained, tmp_path):
    db, _ = trained
    with pytest.raises(AssertionError, match="a run named 'ddp' already exists"): job(tmp_path, db, runs=('ddp',))

def test_store_made_before_ranks_refuses_two_ranks(tmp_path):
    "A store whose keys lack `rank` cannot keep two ranks' rows apart: recording both is refused, one rank is fine."
    db = tmp_path/'old.db'
    eng = sa.create_engine(f'sqlite:///{db}')
    with eng.begin() as c:                              # the layout before ranks: steps and stats keyed without them
        c.exec_driver_sql("CREATE TABLE meta (key VARCHAR PRIMARY KEY, value TEXT)")
        c.exec_driver_sql("INSERT INTO meta VALUES ('schema_version', '2')")
        c.exec_driver_sql("CREATE TABLE steps (run_id INTEGER NOT NULL, step INTEGER NOT NULL, closed FLOAT, n_records INTEGER, "
                          "events_step INTEGER, training INTEGER, PRIMARY KEY (run_id, step))")
        c.exec_driver_sql("CREATE TABLE stats (run_id INTEGER NOT NULL, step INTEGER NOT NULL, module_id INTEGER NOT NULL, "
                          "call INTEGER NOT NULL, ttype VARCHAR NOT NULL, tname VARCHAR NOT NULL, shape VARCHAR, dtype VARCHAR, "
                          "numel FLOAT, mean FLOAT, std FLOAT, min FLOAT, max FLOAT, norm FLOAT, zero_frac FLOAT, nan_count FLOAT, "
                          "inf_count FLOAT, extra TEXT, nbytes INTEGER, PRIMARY KEY (run_id, step, module_id, call, ttype, tname)) WITHOUT ROWID")
    eng.dispose()
    assert not keyed_by_rank(str(db))
    with pytest.raises(AssertionError, match="made before torchember kept ranks apart"): job(tmp_path, str(db), runs=('ddp',))
    job(tmp_path, str(db), runs=('rank0',))
    assert load('rank0', str(db)).df()['rank'].unique().tolist() == [0]


# ---------------------------------------------------------------- PostgreSQL

from test_postgres import server, new_database, drop_database, forget   # a server from $TORCHEMBER_PG_URL, or a skip

def test_postgres_reads_back_as_sqlite(trained, server, tmp_path):
    "The same job recorded into PostgreSQL: every rank's records, steps and scalars read back as from SQLite."
    url = new_database(server)
    try:
        job(tmp_path, url, runs=('ddp', 'accum'))
        lite, _ = trained
        for name in ('ddp', 'accum'):
            pg, sl = load(name, url), load(name, lite)
            assert (pg.ranks, pg.world_size, pg.last_steps) == (sl.ranks, sl.world_size, sl.last_steps) == ([0, 1], 2, {0: 3, 1: 3})
            assert_frame_equal(pg.df(), sl.df(), check_dtype=False)
            assert_frame_equal(pg.latest(), sl.latest(), check_dtype=False)
            assert_frame_equal(pg.df(rank=1, module='2'), sl.df(rank=1, module='2'), check_dtype=False)
            assert_frame_equal(pg.steps().drop(columns='closed'), sl.steps().drop(columns='closed'), check_dtype=False)
            assert_frame_equal(pg.scalars(), sl.scalars(), check_dtype=False)
            assert pg.sequence(rank=1) == sl.sequence(rank=1)
    finally: drop_database(server, url)

def test_postgres_store_made_before_ranks_still_records(server):
    "A PostgreSQL store whose keys lack `rank` is upgraded (rank a defaulted column) and takes single-process runs, late rows too."
    url = new_database(server)
    try:
        engine(url)
        with engine(url).begin() as c:
            for t, key in (('steps', 'step'), ('events', 'step, seq'), ('stats', 'step, module_id, call, ttype, tname'),
                           ('calls', 'step, module_id, call'), ('scalars', 'step, name'), ('snapshots', 'module_id, ttype, tname, call, step')):
                c.exec_driver_sql(f'ALTER TABLE {t} DROP CONSTRAINT {t}_pkey, DROP COLUMN rank CASCADE')
                c.exec_driver_sql(f'ALTER TABLE {t} ADD PRIMARY KEY (run_id, {key})')
            c.exec_driver_sql('DROP TABLE ranks')
            c.exec_driver_sql('ALTER TABLE runs DROP COLUMN world_size')
        forget(url)
        assert not keyed_by_rank(url)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        from torchember import torchEmber
        with torchEmber(model, run='single', db=url, strict=True) as te:
            out = model(torch.randn(4, 3))
            te.flush()                                   # the step is written; its grads come late, and are added to it
            out.sum().backward()
            te.log(loss=1.0); te.log(loss=2.0)          # a value logged again for the same step replaces the first
        r = load('single', url)
        assert set(r.df()['ttype']) == {'input', 'output', 'weight', 'weight_grad'} and r.df()['rank'].unique().tolist() == [0]
        assert r.scalars()[['step', 'rank', 'value']].values.tolist() == [[0, 0, 2.0]]
    finally: drop_database(server, url)
