"""Reliability (issue 5), part 3: bad input gets a clear error at once, and odd names come back exactly as given.

Every refusal happens before the model is armed and before a foreign file is touched; every name (run, module,
tensor, stat) with quotes, SQL, newlines, unicode or path separators round-trips through the store verbatim.
"""
import contextlib, hashlib, os, sqlite3, stat, warnings
from collections import OrderedDict
from pathlib import Path

import pytest, torch
from torch import nn

from torchember import torchEmber, load, runs, default_stats
from torchember.store import StoreError, engine


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

def _step(model, n=1):
    for _ in range(n): model(torch.randn(2, 4)).sum().backward()

def assert_not_armed(model):
    for n, m in model.named_modules():
        assert not (m._forward_hooks or m._forward_pre_hooks), f"module {n!r} was left armed"
        assert 'disarm' not in vars(m)
    for p in model.parameters(): assert not p._post_accumulate_grad_hooks

def digest(path): return hashlib.sha256(Path(path).read_bytes()).hexdigest()

def sql(db, q, *args):
    with contextlib.closing(sqlite3.connect(db)) as c:
        out = c.execute(q, args).fetchall()
        c.commit()
        return out

def copy_store(src, dst):
    "A self-contained copy of store `src` at `dst` (in WAL mode, as torchember keeps it), never opened by this process's engines."
    with contextlib.closing(sqlite3.connect(src)) as s, contextlib.closing(sqlite3.connect(dst)) as d:
        s.backup(d)
        d.execute('PRAGMA journal_mode=WAL')
    assert not Path(str(dst) + '-wal').exists()
    return dst

@pytest.fixture
def made(tmp_path):
    "A store with runs 'alpha' and 'beta' (two steps each of `_mlp`)."
    src = tmp_path/'made.db'
    for name in ('alpha', 'beta'):
        model = _mlp()
        te = torchEmber(model, run=name, db=src)
        _step(model, 2)
        te.disarm()
    return src


# ---------------------------------------------------------------- not a module

class NotAModule:
    def __call__(self, x): return x

@pytest.mark.parametrize('thing', [lambda x: x, torch.zeros(3), 'model.pt', None, nn.Linear, [nn.Linear(2, 2)], NotAModule()],
                         ids=['function', 'tensor', 'str', 'None', 'class', 'list', 'callable'])
def test_non_module_is_a_type_error_naming_the_type(tmp_path, thing):
    db = tmp_path/'never.db'
    with pytest.raises(TypeError) as ei:
        torchEmber(thing, db=db)
    assert type(thing).__name__ in str(ei.value) and 'nn.Module' in str(ei.value)
    assert not db.exists()                                       # refused before touching the store

@pytest.mark.parametrize('every', [0, -1, 1.5, '2', None])
def test_bad_every_is_refused_before_anything_happens(tmp_path, every):
    db, model = tmp_path/'never.db', _mlp()
    with pytest.raises((ValueError, TypeError), match='every'):
        torchEmber(model, db=db, every=every)
    assert not db.exists()
    assert_not_armed(model)


# ---------------------------------------------------------------- unknown runs

def test_unknown_run_names_the_run_and_the_runs_there(made):
    with pytest.raises(KeyError) as ei:
        load('gamma', made)
    msg = ei.value.args[0]
    assert "'gamma'" in msg and "'alpha'" in msg and "'beta'" in msg

def test_unknown_run_in_an_empty_store(tmp_path):
    db = tmp_path/'empty.db'
    engine(db)
    with pytest.raises(KeyError) as ei:
        load('gamma', db)
    assert "'gamma'" in ei.value.args[0] and 'no runs' in ei.value.args[0]

def test_unknown_run_among_many_lists_some(tmp_path):
    db = tmp_path/'many.db'
    for i in range(12): torchEmber(nn.Linear(1, 1), run=f'run{i:02d}', db=db).disarm()
    with pytest.raises(KeyError) as ei:
        load('nope', db)
    msg = ei.value.args[0]
    assert "'nope'" in msg and sum(f"'run{i:02d}'" in msg for i in range(12)) == 10 and '…' in msg


# ---------------------------------------------------------------- paths that are no store

@pytest.mark.parametrize('reader', ['torchEmber', 'runs', 'load'])
def test_directory_as_store(tmp_path, reader):
    model = _mlp()
    call = {'torchEmber': lambda: torchEmber(model, db=tmp_path), 'runs': lambda: runs(tmp_path),
            'load': lambda: load('x', tmp_path)}[reader]
    with pytest.raises(IsADirectoryError) as ei:
        call()
    assert str(tmp_path) in str(ei.value) and 'directory' in str(ei.value)
    assert list(tmp_path.iterdir()) == []                        # nothing created in it
    assert_not_armed(model)

def test_parent_is_a_file(tmp_path):
    (tmp_path/'afile').write_text('x')
    model = _mlp()
    with pytest.raises((StoreError, OSError)) as ei:
        torchEmber(model, db=tmp_path/'afile'/'store.db')
    assert str(tmp_path/'afile') in str(ei.value)
    assert (tmp_path/'afile').read_text() == 'x'
    assert_not_armed(model)

@pytest.mark.parametrize('content', [b'this is not a database\n' * 200, bytes(range(256)) * 64,
                                     b'SQLite format 3\x00' + b'\xff' * 4080], ids=['text', 'binary', 'bad_header'])
@pytest.mark.parametrize('reader', ['torchEmber', 'runs', 'load'])
def test_file_that_is_not_a_database(tmp_path, content, reader):
    f = tmp_path/'notes.db'
    f.write_bytes(content)
    before, model = digest(f), _mlp()
    call = {'torchEmber': lambda: torchEmber(model, db=f), 'runs': lambda: runs(f), 'load': lambda: load('x', f)}[reader]
    with pytest.raises(StoreError, match='not a usable torchember store'):
        call()
    assert digest(f) == before and sorted(p.name for p in tmp_path.iterdir()) == ['notes.db']   # left exactly alone
    assert_not_armed(model)

def test_foreign_sqlite_database_is_refused_and_left_alone(tmp_path):
    "Another application's SQLite file (with a `runs` table of its own) is neither used nor changed."
    f = tmp_path/'app.db'
    sql(f, 'CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT, status TEXT)')
    sql(f, "INSERT INTO runs (name, status) VALUES ('nightly', 'ok')")
    tables = sql(f, "SELECT type, name FROM sqlite_master ORDER BY name")
    model = _mlp()
    with pytest.raises(StoreError):
        torchEmber(model, run='x', db=f)
    assert sql(f, "SELECT type, name FROM sqlite_master ORDER BY name") == tables
    assert_not_armed(model)


# ---------------------------------------------------------------- schema versions

@pytest.mark.parametrize('reader', ['torchEmber', 'runs', 'load'])
def test_newer_schema_version_is_refused(made, tmp_path, reader):
    f = copy_store(made, tmp_path/'future.db')
    sql(f, "UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    before, model = digest(f), _mlp()
    call = {'torchEmber': lambda: torchEmber(model, run='new', db=f), 'runs': lambda: runs(f),
            'load': lambda: load('alpha', f)}[reader]
    with pytest.raises(StoreError) as ei:
        call()
    assert '999' in str(ei.value) and 'newer' in str(ei.value) and 'upgrade' in str(ei.value)
    assert digest(f) == before
    assert_not_armed(model)

def test_garbled_schema_version_is_a_store_error(made, tmp_path):
    f = copy_store(made, tmp_path/'garbled.db')
    sql(f, "UPDATE meta SET value = 'banana' WHERE key = 'schema_version'")
    with pytest.raises(StoreError):
        runs(f)

def test_store_with_an_older_layout_is_refused_or_upgraded(made, tmp_path):
    f = copy_store(made, tmp_path/'older.db')
    cols = [r[1] for r in sql(f, 'PRAGMA table_info(steps)') if not r[5]]   # not part of the key
    sql(f, 'DROP VIEW IF EXISTS sequences')
    sql(f, f'ALTER TABLE steps DROP COLUMN "{cols[-1]}"')
    model = _mlp()
    try:
        te = torchEmber(model, run='new', db=f)
    except StoreError:
        assert_not_armed(model)                                  # refusing clearly at once is fine
        return
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _step(model, 2)
        te.flush()
    assert not [str(w.message) for w in rec if str(w.message).startswith('torchember')]
    assert load('new', f).n_steps == 2
    te.disarm()


# ---------------------------------------------------------------- stat functions and ttypes

def test_unknown_ttype_in_how_record(db):
    model = _mlp()
    te = torchEmber(model, run='ttype', db=db)
    fns = dict(te.stat_fns)
    def gradient_norm(t): return {'gnorm': t.norm()}
    for bad in ('gradient', 'grad', 'inputs', 'Weight', ''):
        with pytest.raises(ValueError) as ei:
            te.how_record(bad, gradient_norm)
        msg = str(ei.value)
        assert repr(bad) in msg and all(tt in msg for tt in ('input', 'output', 'weight', 'weight_grad'))
        with pytest.raises(ValueError):
            te.how_record(bad)(gradient_norm)                    # the decorator form refuses too
    assert te.stat_fns == fns
    with pytest.raises(TypeError, match='callable'):
        te.how_record_grad('not a function')
    assert te.stat_fns == fns
    te.disarm()


# ---------------------------------------------------------------- run names: duplicates and resume

def test_duplicate_run_name_is_refused_and_leaves_the_model_alone(db):
    first = _mlp()
    te = torchEmber(first, run='exp "1"; --', db=db)
    _step(first)
    te.disarm()
    second = _mlp()
    with pytest.raises(ValueError) as ei:
        torchEmber(second, run='exp "1"; --', db=db)
    assert repr('exp "1"; --') in str(ei.value) and 'resume=True' in str(ei.value)
    assert_not_armed(second)
    assert runs(db)['name'].tolist() == ['exp "1"; --'] and load('exp "1"; --', db).n_steps == 1

def test_resume_continues_step_numbering(db):
    model = _mlp()
    te = torchEmber(model, run='long', db=db)
    _step(model, 3)
    te.disarm()
    model2 = _mlp()                                              # a new process, the same architecture
    te2 = torchEmber(model2, run='long', db=db, resume=True)
    _step(model2, 2)
    te2.disarm()
    r = load('long', db)
    df = r.df()
    assert r.n_steps == 5 and r.last_step == 4 and sorted(df.step.unique()) == [0, 1, 2, 3, 4]
    assert df.groupby('step').size().nunique() == 1
    assert len(runs(db)) == 1
    te3 = torchEmber(_mlp(), run='fresh', db=db, resume=True)    # resume of a run that does not exist: a new run
    assert te3.capture.step == -1
    te3.disarm()

def test_resume_with_a_different_model(db):
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    te = torchEmber(a, run='swap', db=db)
    a(torch.randn(2, 4))
    te.disarm()
    b = nn.Sequential(nn.Conv1d(1, 1, 1), nn.Tanh(), nn.Linear(4, 1))
    try:
        te = torchEmber(b, run='swap', db=db, resume=True)
    except (ValueError, StoreError) as e:                        # refusing clearly is fine
        assert 'swap' in str(e)
        assert_not_armed(b)
        return
    b(torch.randn(2, 1, 4))
    latest = te.latest()
    assert set(zip(latest.module, latest.mtype)) == {(n, type(m).__name__) for n, m in b.named_modules()}
    te.disarm()


# ---------------------------------------------------------------- names that must come back verbatim

ODD = ['quote"double', "quote'single", 'semi;colon; DROP TABLE runs; --', '-- comment', 'new\nline\tand tab',
       'ünïcödé 🔥 名前', 'path/sep\\back/../..', ' spaced ', '%_like_wildcards%', 'nul\x00byte', "x' OR '1'='1"]

@pytest.mark.parametrize('name', ODD)
def test_odd_run_names_round_trip(db, name):
    model = _mlp()
    te = torchEmber(model, run=name, db=db)
    _step(model, 2)
    te.disarm()
    assert runs(db)['name'].tolist() == [name]
    r = load(name, db)
    assert r.name == name and r.n_steps == 2
    df = r.df()
    assert set(df.run) == {name} and len(df) == 2 * len(r.latest())
    with pytest.raises(KeyError):                                # no prefix or pattern matching
        load(name[:-1] + '?', db)

class Named(nn.Module):
    "Sub-modules under odd names; forward takes odd keyword names and returns a dict with odd keys."
    def __init__(self, names):
        super().__init__()
        self.blocks = nn.ModuleDict({n: nn.Linear(3, 3) for n in names})
        self.add_module(names[0] + ' (direct)', nn.Linear(3, 3))
    def forward(self, x, **extra):
        out = {}
        for n, block in self.blocks.items(): out[n] = block(x + sum(extra.values()))
        out['direct'] = getattr(self, self._direct)(x)
        return out
    @property
    def _direct(self): return [n for n in self._modules if n.endswith('(direct)')][0]

MODULE_NAMES = [n for n in ODD if '.' not in n] + ['x"y', 'dot-less_name']   # torch forbids '.' in a name, and ''

def test_odd_module_tensor_and_stat_names_round_trip(db):
    torch.manual_seed(0)
    model = Named(MODULE_NAMES)
    kw = {n: torch.ones(3) for n in ("it's", 'k;--', 'new\nline', 'ü🔥')}
    stat_names = ['quo"te', "it's", 'semi; DROP TABLE stats; --', 'new\nline', 'ünï 🔥', 'a/b\\c', 'a.b', ' ', '']
    te = torchEmber(model, run='odd names', db=db)
    te.how_record_out(lambda t: {**default_stats(t), **{s: float(i) for i, s in enumerate(stat_names)}})
    model(torch.randn(2, 3), **kw)['direct'].sum().backward()
    te.flush()
    r = load('odd names', db)
    df = r.df()
    names = {n for n, _ in model.named_modules()}
    called = names - {'blocks'}                                  # the ModuleDict itself is never called and owns no weight
    assert set(df.module) == called                              # every module, named exactly as torch names it
    assert {n: m for n, m in zip(df.module, df.mtype)} == {n: type(m).__name__ for n, m in model.named_modules() if n in called}
    assert {f'blocks.{n}' for n in MODULE_NAMES} <= names
    for n in MODULE_NAMES:                                       # the module filter finds each one, and only it
        assert set(r.df(module=f'blocks.{n}').module) == {f'blocks.{n}'}
    seq = r.sequence()
    assert all(f'enter blocks.{n}' in seq for n in MODULE_NAMES)
    tree_names = set()
    def walk(node): tree_names.add(node['name']); [walk(c) for c in node['children']]
    walk(r.tree())
    assert tree_names == names
    root_in = set(df[(df.module == '') & (df.ttype == 'input')].tname)
    assert root_in == {'x'} | set(kw)                            # keyword argument names
    root_out = set(df[(df.module == '') & (df.ttype == 'output')].tname)
    assert root_out == {f'output.{n}' for n in MODULE_NAMES} | {'output.direct'}
    out = df[df.ttype == 'output']
    for i, s in enumerate(stat_names):                           # custom stat names, as columns
        assert s in df.columns, f"stat {s!r} missing"
        assert (out[s] == float(i)).all()

def test_custom_stat_named_like_a_column_is_not_silently_dropped(db):
    model = _mlp()
    te = torchEmber(model, run='collide', db=db)
    clash = {'step': 1.0, 'module': 2.0, 'call': 3.0, 'shape': 4.0, 'dtype': 5.0}
    te.how_record_out(lambda t: {**default_stats(t), **clash})
    model(torch.randn(2, 4))
    out = te.latest().query("ttype == 'output'")
    values = {k: set(v) for k, v in out.items()}
    assert all(any(v == {x} for v in values.values()) for x in clash.values()), "a custom stat value vanished"
    te.disarm()


# ---------------------------------------------------------------- file modes

@pytest.mark.parametrize('umask', [0o022, 0o000], ids=['umask022', 'umask000'])
def test_new_store_is_private(tmp_path, umask):
    db = tmp_path/'a'/'b'/'private'/'store.db'
    old = os.umask(umask)
    try:
        model = _mlp()
        te = torchEmber(model, run='private', db=db)
        _step(model, 2)
        te.flush()
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        for side in ('-wal', '-shm'):                            # the WAL holds records too until checkpointed
            p = Path(str(db) + side)
            if p.exists(): assert stat.S_IMODE(p.stat().st_mode) == 0o600, side
        te.disarm()
    finally:
        os.umask(old)


WRAPPER_WEIGHTS = '''
import sys, torch
from torch import nn
from torch.utils._pytree import tree_map
from torchember import torchEmber

class Wrapped(torch.Tensor):
    "A wrapper subclass (as DTensor or a quantized weight): no storage of its own, data_ptr() is 0."
    @staticmethod
    def __new__(cls, elem): return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
    def __init__(self, elem): self.elem = elem
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        un = lambda x: x.elem if isinstance(x, Wrapped) else x
        return tree_map(lambda x: Wrapped(x) if isinstance(x, torch.Tensor) else x, func(*tree_map(un, args), **tree_map(un, kwargs or {})))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 1))
te = torchEmber(model, run='wrapped', db=sys.argv[1])
with torch.no_grad():
    model(torch.randn(2, 300))                         # the weights of a plain model: the kernel's plan is made
    model[0].weight = nn.Parameter(Wrapped(model[0].weight.detach().clone()), requires_grad=False)
    model(torch.randn(2, 300).requires_grad_(False))   # the same names and shapes, now a tensor subclass
te.disarm()
df = te.run.df(ttype='weight', module='0')
w = df.set_index(['step', 'tname'])[['numel', 'mean', 'std', 'min', 'max', 'norm']]
print(sorted(df.step.unique().tolist()), len(df), bool(((w.loc[1] - w.loc[0]).abs() <= 1e-5 * w.loc[0].abs().clip(lower=1)).all().all()))   # torch's kernels sum large float32 tensors in float32: ~log2(n) roundings of 6e-8
'''

def test_weights_that_become_a_tensor_subclass_are_not_read_as_plain_memory(tmp_path):
    "A weight swapped for a storage-less tensor subclass (same name, shape and dtype) is measured through torch, never read at address 0."
    import subprocess, sys
    script = tmp_path/'wrapped.py'
    script.write_text(WRAPPER_WEIGHTS)
    p = subprocess.run([sys.executable, str(script), str(tmp_path/'w.db')], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == '[0, 1] 4 True', p.stdout   # both steps, the same values (nothing trained)

def test_a_store_in_a_new_folder_is_said_once(tmp_path):
    "A typo in a store's folder would make a new store silently: the folder made for it is said, an existing one is not."
    import warnings, torch
    from torchember import torchEmber
    db = tmp_path/'typo'/'nested'/'store.db'
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(torch.nn.Linear(2, 2), run='new-folder', db=str(db))
        te.disarm()
        te2 = torchEmber(torch.nn.Linear(2, 2), run='same-folder', db=str(db))
        te2.disarm()
    said = [str(w.message) for w in rec if 'in a folder made for it' in str(w.message)]
    assert len(said) == 1 and str(db) in said[0]

def test_a_taken_run_name_names_both_ways_out(tmp_path):
    import torch, pytest
    from torchember import torchEmber
    db = str(tmp_path/'s.db')
    torchEmber(torch.nn.Linear(2, 2), run='taken', db=db).disarm()
    with pytest.raises(ValueError, match='resume=True.*overwrite=True'):
        torchEmber(torch.nn.Linear(2, 2), run='taken', db=db)
