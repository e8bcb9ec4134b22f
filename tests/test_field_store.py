"""Field-proof store (issue 17, items 11-15 and 17's folders): the store holds in the setups people train in.

Two live processes resuming one run, a store deleted under a live process, in-memory URLs, another application's
database, names SQLite cannot store, and the folders a new store needs. Where the store is involved each test runs on
SQLite and on PostgreSQL (the server of `$TORCHEMBER_PG_URL`; without one the PostgreSQL variants skip).
"""
import hashlib, os, signal, sqlite3, subprocess, sys, textwrap, warnings
from pathlib import Path

import pytest, torch
import sqlalchemy as sa
from torch import nn

from torchember import torchEmber, load, runs, Run
from torchember.store import StoreError, engine, db_url, _engines
from test_postgres import server, new_database, drop_database, forget   # the PostgreSQL fixtures



def train(te, model, steps=3):
    for _ in range(steps): model(torch.randn(2, 4)).sum().backward()
    te.flush()


# ---------------------------------------------------------------- 11: two live writers of one run and rank

HOLD = textwrap.dedent('''
    import sys, torch
    from torch import nn
    from torchember import torchEmber
    m = nn.Linear(4, 2)
    te = torchEmber(m, run='shared', db=sys.argv[1], resume=True)
    for _ in range(3): m(torch.randn(2, 4)).sum().backward()
    te.flush()
    print('ready', flush=True)
    sys.stdin.read()
''')

def test_second_live_writer_refused(store, tmp_path):
    "While a process records run 'shared' (rank 0), a second process resuming it is refused, naming the holder; once the holder is killed with SIGKILL, resuming works."
    (tmp_path/'hold.py').write_text(HOLD)
    holder = subprocess.Popen([sys.executable, str(tmp_path/'hold.py'), store], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'ready'
        m = nn.Linear(4, 2)
        with pytest.raises((StoreError, ValueError)) as e: torchEmber(m, run='shared', db=store, resume=True)
        msg = str(e.value)
        assert "'shared'" in msg and 'rank 0' in msg and str(holder.pid) in msg, msg
    finally:
        holder.kill(); holder.wait()
    te = torchEmber(m, run='shared', db=store, resume=True)   # a killed holder does not block resuming
    assert te.capture.step == 2
    train(te, m, 2)
    te.disarm()
    assert Run('shared', store).n_steps == 5

def test_second_live_writer_refused_while_creating(store, tmp_path):
    "A process that created a run (no resume) holds it too: resuming it from another process while it lives is refused."
    (tmp_path/'hold.py').write_text(HOLD.replace(', resume=True', ''))
    holder = subprocess.Popen([sys.executable, str(tmp_path/'hold.py'), store], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'ready'
        with pytest.raises((StoreError, ValueError), match=str(holder.pid)): torchEmber(nn.Linear(4, 2), run='shared', db=store, resume=True)
    finally:
        holder.stdin.close(); holder.wait()   # a holder that ended cleanly lets go too
    te = torchEmber(nn.Linear(4, 2), run='shared', db=store, resume=True)
    te.disarm()


# ---------------------------------------------------------------- 12: a store deleted while the process lives

def test_deleted_store_reopened(tmp_path):
    "A store file deleted (with its -wal and -shm) while the process lives: a new run on the same path lands in a new file on disk."
    db = tmp_path/'store.db'
    m = nn.Linear(4, 2)
    te = torchEmber(m, run='first', db=str(db))
    train(te, m)
    te.disarm()
    for suffix in ('', '-wal', '-shm'): Path(f'{db}{suffix}').unlink(missing_ok=True)
    m = nn.Linear(4, 2)
    te = torchEmber(m, run='second', db=str(db))
    train(te, m)
    te.disarm()
    assert db.exists()
    with sqlite3.connect(db) as c:   # on disk, read without torchember's engine
        assert c.execute('SELECT name FROM runs').fetchall() == [('second',)]
        assert c.execute('SELECT count(*) FROM steps').fetchone() == (3,)
    assert runs(str(db))['name'].tolist() == ['second']

def test_deleted_store_warns_live_run(tmp_path):
    "A run still recording when its store is deleted is told so (the writer's warning), instead of writing into the vanished file."
    db = tmp_path/'store.db'
    m = nn.Linear(4, 2)
    te = torchEmber(m, run='first', db=str(db))
    train(te, m)
    for suffix in ('', '-wal', '-shm'): Path(f'{db}{suffix}').unlink(missing_ok=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        train(te, m)
        te.disarm()
    assert any('deleted' in str(x.message) or 'replaced' in str(x.message) for x in w), [str(x.message) for x in w]


# ---------------------------------------------------------------- 13: in-memory stores

@pytest.mark.parametrize('url', ['sqlite://', 'sqlite:///:memory:', ':memory:'])
def test_in_memory_store(url, tmp_path, monkeypatch):
    "An in-memory URL is a real store for the process: training writes it (from the writer thread) and every reader reads it back."
    monkeypatch.chdir(tmp_path)
    m = nn.Linear(4, 2)
    te = torchEmber(m, run=f'mem-{hashlib.md5(url.encode()).hexdigest()[:6]}', db=url, strict=True)
    te.log(loss=1.5)
    train(te, m)
    assert len(te.df()) > 0
    te.disarm()
    r = Run(te.run_name, url)
    assert r.n_steps == 3 and len(load(te.run_name, url).df()) == len(te.df())
    assert te.run_name in runs(url)['name'].tolist()
    assert list(tmp_path.iterdir()) == []    # no file named ':memory:' (or anything else)

def test_in_memory_spellings_are_one_store():
    "`:memory:`, `sqlite://` and `sqlite:///:memory:` name the one in-memory store of the process."
    assert db_url(':memory:') == db_url('sqlite://') == db_url('sqlite:///:memory:')


# ---------------------------------------------------------------- 14: another application's database

def foreign_sqlite(path, meta=False):
    with sqlite3.connect(path) as c:
        c.execute('CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)')
        c.execute('INSERT INTO invoices VALUES (1, 9.5)')
        if meta: c.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)"); c.execute("INSERT INTO meta VALUES ('owner', 'app')")
    c.close()

@pytest.mark.parametrize('meta', [False, True])
def test_foreign_sqlite_untouched(tmp_path, meta):
    "Another application's SQLite file (rollback journal; with or without a table named `meta`) is refused by runs, load and torchEmber, and stays byte-identical in its journal mode."
    app = tmp_path/'app.db'
    foreign_sqlite(app, meta)
    before = app.read_bytes()
    for attempt in (lambda: runs(str(app)), lambda: load('x', str(app)), lambda: torchEmber(nn.Linear(4, 2), db=str(app))):
        with pytest.raises(StoreError, match='not a torchember store'): attempt()
    assert app.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['app.db']   # no -wal, -shm or -journal left
    with sqlite3.connect(app) as c: assert c.execute('PRAGMA journal_mode').fetchone() == ('delete',)

def test_foreign_postgres_untouched(server):
    "A PostgreSQL database of another application with a table named `meta` is refused and gets no torchember table."
    url = new_database(server)
    try:
        with sa.create_engine(url).begin() as c:
            c.exec_driver_sql('CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)')
            c.exec_driver_sql("INSERT INTO meta VALUES ('owner', 'app')")
        with pytest.raises(StoreError, match='not a torchember store'): runs(url)
        with sa.create_engine(url).connect() as c: assert sa.inspect(c).get_table_names() == ['meta']
    finally: drop_database(server, url)


# ---------------------------------------------------------------- 15: names SQLite cannot store

def test_bad_scalar_name_refused(store):
    "A scalar name with a lone surrogate is refused at te.log, naming it; the steps go on being written."
    m = nn.Linear(4, 2)
    te = torchEmber(m, run='s', db=store, strict=True)
    with pytest.raises(ValueError, match='loss'): te.log(**{'loss\ud800': 1.0})
    te.log(loss=2.0)
    train(te, m)
    te.disarm()
    assert Run('s', store).n_steps == 3

def test_bad_run_name_refused(store):
    with pytest.raises(ValueError, match='run name'): torchEmber(nn.Linear(4, 2), run='r\ud800', db=store)

class Odd(nn.Module):
    "A model whose module and parameter names hold lone surrogates."
    def __init__(self):
        super().__init__()
        self.add_module('lin\udcff', nn.Linear(4, 2))
        self.register_parameter('w\ud800', nn.Parameter(torch.ones(2)))
    def forward(self, x): return getattr(self, 'lin\udcff')(x) * getattr(self, 'w\ud800')

def test_surrogate_model_names_stored_escaped(store):
    "Module, parameter and custom stat names from the model are stored escaped; every step is written."
    m = Odd()
    te = torchEmber(m, run='odd', db=store, strict=True)
    te.how_record_out(lambda t: {'mean': t.mean(), 'odd\ud800': t.abs().max()})
    train(te, m)
    te.disarm()
    df = load('odd', store).df()
    assert Run('odd', store).n_steps == 3
    assert 'lin\\udcff' in set(df['module']) and 'w\\ud800' in set(df['tname'])
    assert df.filter(like='odd').notna().any().any()


# ---------------------------------------------------------------- 17: folders a new store needs

def test_new_folders_private(tmp_path):
    "Every folder made for a new store is 0700, whatever the umask."
    old = os.umask(0)
    try: engine(tmp_path/'a'/'b'/'c'/'store.db')
    finally: os.umask(old)
    for d in ('a', 'a/b', 'a/b/c'): assert oct((tmp_path/d).stat().st_mode & 0o777) == '0o700', d
    assert oct((tmp_path/'a/b/c/store.db').stat().st_mode & 0o777) == '0o600'


def test_disarm_gives_the_rank_back_and_arm_claims_it_again(store, tmp_path):
    "A notebook that finished training lets another process resume its run; arming again claims it again."
    from torchember import torchEmber
    model = torch.nn.Linear(3, 1)
    te = torchEmber(model, run="nb", db=store)
    model(torch.randn(2, 3)).sum().backward()
    te.disarm()
    code = f"import torch; from torchember import torchEmber; m = torch.nn.Linear(3, 1); te = torchEmber(m, run='nb', db={store!r}, resume=True); m(torch.randn(2, 3)).sum().backward(); te.disarm(); print('resumed')"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert 'resumed' in r.stdout, r.stderr[-2000:]
    te.arm()     # claimed again by this process: now another is refused
    holder = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert 'being recorded by another live process' in holder.stderr, holder.stderr[-2000:]
    te.disarm()


def test_reading_a_name_no_store_can_hold_is_an_unknown_run(store):
    "Reading a run under a name with a lone surrogate says there is no such run, not a raw UnicodeEncodeError."
    from torchember import load
    model = nn.Linear(4, 1)
    te = torchEmber(model, run='fine', db=store)
    train(te, model)
    te.disarm()
    with pytest.raises(KeyError, match='fine'): load('loss\ud800', store)   # the message lists the runs there

def test_a_deleted_runs_id_is_never_given_again(store):
    "SQLite gives the largest id plus one: a run read before its delete would read the next run's rows as its own."
    from torchember import delete_run
    m = nn.Linear(2, 2)
    with torchEmber(m, run='old', db=store): m(torch.randn(1, 2)).sum().backward()
    stale = load('old', store)
    delete_run('old', db=store)
    with torchEmber(m, run='new', db=store): m(torch.randn(1, 2)).sum().backward()
    assert load('new', store).id != stale.id and stale.df().empty
    with torchEmber(m, run='new', db=store, overwrite=True): m(torch.randn(1, 2)).sum().backward()
    ids = [stale.id, load('new', store).id]
    assert ids[1] > ids[0] + 1
