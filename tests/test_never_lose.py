"""Reliability (issue 5), part 2: what was flushed is never lost, and a store in trouble never stops training.

Real processes are killed with SIGKILL mid-run, read while they write, and run side by side on one store; the store
is locked, made read-only, and filled up (a size-capped SQLite file in-process, a tiny tmpfs where the machine
lets us mount one).
"""
import contextlib, json, os, shutil, signal, sqlite3, subprocess, sys, textwrap, threading, time, warnings
from collections import OrderedDict
from pathlib import Path

import pytest, torch
from torch import nn
from sqlalchemy import event

from torchember import torchEmber, load, runs
from torchember.store import StoreError, engine


# ---------------------------------------------------------------- a training script, run as a real process

TRAIN = textwrap.dedent('''
    import os, sys
    import torch
    from torch import nn
    from torchember import torchEmber
    db, run, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    width, depth = int(os.environ.get('TE_WIDTH', '8')), int(os.environ.get('TE_DEPTH', '1'))
    strict = os.environ.get('TE_STRICT') == '1'
    torch.manual_seed(0)
    layers = []
    for _ in range(depth): layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if os.environ.get('TE_WAIT'):                # start together with another process
        print('ready', flush=True)
        sys.stdin.readline()
    te = torchEmber(model, run=run, db=db, strict=strict)
    for step in range(steps):
        loss = model(torch.randn(16, width)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        if (step + 1) % every == 0:
            try:
                te.flush()
                print(step, flush=True)
            except Exception as e:
                print('raised', type(e).__name__, str(e).replace(chr(10), ' ')[:300], flush=True)
    if not os.environ.get('TE_NO_DISARM'): te.disarm()
    print('done', flush=True)
''')

def rows_per_step(depth=1):
    "Rows of one step of TRAIN's model: an input and an output per module, a weight and a grad per parameter."
    modules = 1 + 2 * depth + 1
    params = 2 * (depth + 1)
    return 2 * modules + 2 * params

def script(tmp_path, text=TRAIN, name='train.py'):
    p = tmp_path/name
    p.write_text(text)
    return str(p)

def env(**extra):
    e = {**os.environ, 'TORCHEMBER_COMPILE': '0', 'PYTHONUNBUFFERED': '1'}
    e.update({k: str(v) for k, v in extra.items()})
    return e

def start(tmp_path, db, run, steps, every, stdin=None, **extra):
    return subprocess.Popen([sys.executable, script(tmp_path), str(db), run, str(steps), str(every)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True, env=env(**extra))

def finish(p, timeout=120):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"training process failed ({p.returncode}):\n{err[-3000:]}"
    return out, err

def te_warnings(stderr):
    "The torchember warnings a process printed (one entry per warning; a message may span lines)."
    return ['torchember:' + w for w in stderr.split('Warning: torchember:')[1:]]

def tw(rec):
    "The torchember warnings among `rec` (a `catch_warnings(record=True)` list)."
    return [str(w.message) for w in rec if str(w.message).startswith('torchember')]

def sql(db, q):
    with contextlib.closing(sqlite3.connect(db)) as c: return c.execute(q).fetchall()

def check_whole(db, run, per_step):
    "Every stored step of `run` has all its rows (stats count == n_records == per_step); the file passes integrity_check. Its steps."
    assert sql(db, 'PRAGMA integrity_check') == [('ok',)]
    r = load(run, db)
    df = r.df()
    sizes = df.groupby('step').size().to_dict()
    stored = dict(sql(db, f"SELECT s.step, s.n_records FROM steps s JOIN runs r ON r.id = s.run_id WHERE r.name = '{run}'"))
    assert sorted(sizes) == sorted(stored), "rows of a step whose `steps` row is missing (or the reverse)"
    for step, n in sizes.items():
        assert n == per_step and stored[step] == per_step, f"step {step} has {n} rows ({stored[step]} announced), not {per_step}"
    return sorted(sizes)


# ---------------------------------------------------------------- kill -9

def kill_after(p, step:int, sig=signal.SIGKILL)->int:
    "Send `sig` to training process `p` once it has flushed `step` (or ended); the last step it said it flushed."
    last = -1
    try:
        for line in p.stdout:
            last = int(line)
            if last >= step: break
    finally:
        p.send_signal(sig)
        p.wait(timeout=60)
    return last

def test_sigkill_mid_run_keeps_every_flushed_step_whole(tmp_path):
    db = tmp_path/'killed.db'
    p = start(tmp_path, db, 'killed', steps=10**6, every=3)
    last = kill_after(p, 40)
    assert p.returncode == -signal.SIGKILL and last >= 40, p.stderr.read()[-3000:]
    steps = check_whole(str(db), 'killed', rows_per_step())
    assert steps == list(range(len(steps))), "a gap in the stored steps"
    assert steps[-1] >= last                      # everything flushed before the kill is there
    assert runs(db).set_index('name').loc['killed', 'last_step'] == steps[-1]


def test_normal_exit_without_flush_keeps_the_last_step(tmp_path):
    "A script that trains and just ends (no flush, no disarm) keeps every step, the one still open included."
    db = tmp_path/'exit.db'
    p = start(tmp_path, db, 'exit', steps=5, every=10**6, TE_NO_DISARM=1)
    finish(p)
    assert check_whole(str(db), 'exit', rows_per_step()) == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- readers and writers at once

def test_reader_sees_only_whole_steps_while_a_process_trains(tmp_path):
    db = tmp_path/'live.db'
    engine(db)                                           # the store exists before the writer starts
    p = start(tmp_path, db, 'live', steps=150, every=2)
    seen, reads, per_step = set(), 0, rows_per_step()
    try:
        while p.poll() is None:
            if 'live' not in runs(db)['name'].tolist():
                time.sleep(0.05)
                continue
            r = load('live', db)
            latest = r.latest()
            assert len(latest) in (0, per_step), f"a reader saw a partial step: {len(latest)} rows"
            assert latest.step.nunique() <= 1
            sizes = r.df().groupby('step').size()
            assert (sizes == per_step).all(), f"partial steps seen: {sizes[sizes != per_step].to_dict()}"
            seen |= set(sizes.index)
            reads += 1
    finally:
        out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert not te_warnings(err), te_warnings(err)
    assert reads >= 3 and seen, "the reader never overlapped the writer; the test proved nothing"
    assert check_whole(str(db), 'live', per_step) == list(range(150))


def test_two_processes_write_two_runs_into_one_store(tmp_path):
    db = tmp_path/'shared.db'
    engine(db)                                           # see test_concurrent_first_open_of_a_fresh_store for a fresh one
    ps = {'narrow': start(tmp_path, db, 'narrow', steps=60, every=5, stdin=subprocess.PIPE, TE_WAIT=1, TE_WIDTH=8, TE_DEPTH=1),
          'deep': start(tmp_path, db, 'deep', steps=60, every=5, stdin=subprocess.PIPE, TE_WAIT=1, TE_WIDTH=5, TE_DEPTH=3)}
    for p in ps.values(): assert p.stdout.readline().strip() == 'ready'
    for p in ps.values(): p.stdin.write('go\n'); p.stdin.flush()
    for name, p in ps.items():
        out, err = finish(p)
        assert out.strip().endswith('done') and not te_warnings(err), err[-3000:]
    assert check_whole(str(db), 'narrow', rows_per_step(1)) == list(range(60))
    assert check_whole(str(db), 'deep', rows_per_step(3)) == list(range(60))
    for name, width, depth in (('narrow', 8, 1), ('deep', 5, 3)):
        df = load(name, db).df()
        assert set(df.module) == {''} | {str(i) for i in range(2 * depth + 1)}
        w = df[(df.ttype == 'weight') & (df.tname == 'weight') & (df.module == '0')]
        assert set(w['shape']) == {(width, width)}
    assert sorted(runs(db)['name']) == ['deep', 'narrow']


RACE = textwrap.dedent('''
    import sys
    from torchember.store import engine
    print('ready', flush=True)
    for line in sys.stdin:
        try: engine(line.strip()); print('ok', flush=True)
        except Exception as e: print('ERR', type(e).__name__, str(e).replace(chr(10), ' ')[:300], flush=True)
''')

def test_concurrent_first_open_of_a_fresh_store(tmp_path):
    "Two jobs launched together on a new store (the default store on a fresh machine, say) both get to train."
    ps = [subprocess.Popen([sys.executable, script(tmp_path, RACE, 'race.py')], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()) for _ in range(2)]
    try:
        for p in ps: assert p.stdout.readline().strip() == 'ready'
        errors = []
        for i in range(10):                              # ten fresh stores, each opened by both at the same moment
            path = tmp_path/f'fresh{i}'/'store.db'
            if i % 2: path.parent.mkdir()                # half of them in a directory that exists already
            for p in ps: p.stdin.write(f'{path}\n'); p.stdin.flush()
            errors += [line for p in ps if (line := p.stdout.readline().strip()) != 'ok']
    finally:
        for p in ps: p.stdin.close(); p.wait(timeout=60)
    assert not errors, errors[:3]


# ---------------------------------------------------------------- a locked store

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

def _big():
    "About 120 rows a step: too many to fit in the free space of a store's existing pages, so a capped store refuses each step."
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(8, 8), nn.ReLU())], nn.Linear(8, 1))

def _steps(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n): model(torch.randn(4, 8, generator=g)).sum().backward()

@pytest.mark.parametrize('writer', ['thread', 'process'])   # the writer thread writes, or hands each transaction to a process
def test_store_locked_by_another_connection_waits_and_succeeds(db, writer, monkeypatch):
    monkeypatch.setenv('TORCHEMBER_WRITER', writer)
    model = _mlp()
    te = torchEmber(model, run='locked', db=db)
    _steps(model, 1)
    te.flush()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute('BEGIN EXCLUSIVE')
        try:
            _steps(model, 4, seed=1)                     # training goes on while the store is locked
            time.sleep(1.5)                              # the writer is waiting on the lock by now
            assert sql(db, 'SELECT count(*) FROM steps') == [(1,)], "the lock did not hold the writer back"
        finally:
            holder.execute('COMMIT')
            holder.close()
        te.flush()
    assert not tw(rec)
    per_step = len(te.latest())
    assert check_whole(db, 'locked', per_step) == [0, 1, 2, 3, 4]
    te.disarm()


# ---------------------------------------------------------------- a full disk

@contextlib.contextmanager
def store_capped(eng):
    "New connections of `eng` may not grow the database file: SQLite answers SQLITE_FULL 'database or disk is full'."
    def cap(dbapi_conn, _):
        c = dbapi_conn.cursor()
        n = c.execute('PRAGMA page_count').fetchone()[0]
        c.execute(f'PRAGMA max_page_count = {n}')
        c.close()
    event.listen(eng, 'connect', cap)
    eng.dispose()
    try: yield
    finally:
        event.remove(eng, 'connect', cap)
        eng.dispose()

def test_full_disk_warns_once_and_training_goes_on(db, thread_writer):
    model, bare = _mlp(), _mlp()
    te = torchEmber(model, run='full', db=db)
    _steps(model, 2); _steps(bare, 2)
    te.flush()
    per_step = len(te.latest())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        with store_capped(te.engine):
            for seed in range(1, 11):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
                o1, o2 = bare(x), model(x)
                assert torch.equal(o1, o2)
                o1.sum().backward(); o2.sum().backward()
            te.flush()
        msgs = tw(rec)
        assert len(msgs) == 1 and 'database or disk is full' in msgs[0], msgs
        for p1, p2 in zip(bare.parameters(), model.parameters()): assert torch.equal(p1.grad, p2.grad)
        _steps(model, 2, seed=99)                        # space again: recording resumes
        te.flush()
    steps = check_whole(db, 'full', per_step)            # the lost steps are lost whole, never in part
    assert steps[:2] == [0, 1] and steps[-2:] == [12, 13] and len(steps) < 14
    te.disarm()

def test_full_disk_with_strict_raises_from_flush(db, thread_writer):
    model = _big()
    te = torchEmber(model, run='full-strict', db=db, strict=True)
    _steps(model, 1)
    te.flush()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        with store_capped(te.engine):
            _steps(model, 1, seed=1)                     # one step, one failed write
            with pytest.raises(Exception, match='database or disk is full'):
                te.flush()
        _steps(model, 2, seed=2)                         # space again: the error was raised once, not again
        te.flush()
    assert not tw(rec)                                   # strict raises instead of warning
    assert check_whole(db, 'full-strict', len(te.latest())) == [0, 2, 3]
    te.disarm()

def test_full_disk_with_strict_is_not_silent_at_disarm(db, thread_writer):
    "With strict=True nothing warns, so a write that fails after the last flush() must raise from disarm()."
    model = _big()
    te = torchEmber(model, run='full-strict-exit', db=db, strict=True)
    _steps(model, 1)
    te.flush()
    with store_capped(te.engine):
        _steps(model, 1, seed=1)
        with pytest.raises(Exception, match='database or disk is full'):
            te.disarm()

DISK = textwrap.dedent('''
    set -e
    mount -t tmpfs -o size=512k tmpfs "$MNT"
    "$PY" "$SCRIPT" "$MNT/store.db" tiny 300 10 > "$OUT/stdout" 2> "$OUT/stderr" || echo "exit $?" >> "$OUT/stdout"
    cp "$MNT"/store.db* "$OUT/"
''')

def test_really_full_filesystem(tmp_path):
    "A store on a 512 KiB tmpfs, in a mount namespace of its own (needs root and CAP_SYS_ADMIN, or user namespaces)."
    if not shutil.which('unshare'): pytest.skip("no `unshare` to make a private mount namespace for a tiny filesystem")
    mnt, out = tmp_path/'mnt', tmp_path/'out'
    mnt.mkdir(); out.mkdir()
    sh = tmp_path/'disk.sh'
    sh.write_text(DISK)
    cmd = ['unshare', '-m'] if os.geteuid() == 0 else ['unshare', '-r', '-m']
    probe = subprocess.run(cmd + ['sh', '-c', f'mount -t tmpfs -o size=512k tmpfs {mnt}'], capture_output=True, text=True)
    if probe.returncode: pytest.skip(f"cannot mount a tiny tmpfs here ({probe.stderr.strip()}); "
                                     "test_full_disk_warns_once_and_training_goes_on covers this with a size-capped store")
    r = subprocess.run(cmd + ['sh', str(sh)], capture_output=True, text=True, timeout=300,
                       env=env(MNT=mnt, OUT=out, PY=sys.executable, SCRIPT=script(tmp_path)))
    assert r.returncode == 0, r.stderr
    stdout, stderr = (out/'stdout').read_text(), (out/'stderr').read_text()
    assert stdout.strip().endswith('done') and 'raised' not in stdout, f"training did not finish:\n{stdout[-2000:]}\n{stderr[-3000:]}"
    w = te_warnings(stderr)
    assert len(w) == 2 and 'database or disk is full' in w[0], stderr[-3000:]   # at the first loss, and how many at the end
    steps = check_whole(str(out/'store.db'), 'tiny', rows_per_step())
    assert steps and len(steps) < 300, "the disk never filled up"
    assert 'lost since writing to the store failed' in w[1] and int(w[1].split()[1]) == 300 - len(steps), w[1]


# ---------------------------------------------------------------- a read-only store

def _probe_writable(path:Path)->bool:
    "Can this process still write at `path` (a directory: create a file in it; a file: open it for appending)?"
    try:
        if path.is_dir():
            f = path/'.probe'
            f.write_text('x'); f.unlink()
        else:
            with open(path, 'ab'): pass
        return True
    except OSError: return False

@contextlib.contextmanager
def read_only(*paths):
    """Make `paths` unwritable for this process: chmod (dirs 0o500, files 0o400); as root, where chmod stops nothing,
    the immutable attribute (`chattr +i`, needs CAP_LINUX_IMMUTABLE). Skips the test if neither works."""
    paths = [Path(p) for p in paths]
    modes = {p: p.stat().st_mode & 0o777 for p in paths}
    for p in paths: p.chmod(0o500 if p.is_dir() else 0o400)
    immutable = []
    try:
        if any(_probe_writable(p) for p in paths):
            how = "running as root, chmod does not stop writes"
            if shutil.which('chattr'):
                for p in paths:
                    if subprocess.run(['chattr', '+i', str(p)], capture_output=True).returncode == 0: immutable.append(p)
            if any(_probe_writable(p) for p in paths):
                pytest.skip(f"cannot make a path read-only here ({how}, and `chattr +i` is not permitted)")
        yield
    finally:
        for p in immutable: subprocess.run(['chattr', '-i', str(p)], capture_output=True)
        for p, m in modes.items(): p.chmod(m)

def _closed_store(tmp_path, name):
    "A store holding run 'archived' (one step of `_mlp`), every connection to it closed (no -wal or -shm left)."
    d = tmp_path/name
    d.mkdir()
    model = _mlp()
    te = torchEmber(model, run='archived', db=d/'store.db')
    _steps(model, 1)
    te.disarm()
    te.engine.dispose()
    from torchember.store import _engines, db_url
    _engines.pop(db_url(d/'store.db'), None)             # as a new process finds it: no engine opened yet
    assert sorted(x.name for x in d.iterdir()) == ['store.db']
    return d, d/'store.db'

ARCHIVED_ROWS = rows_per_step(1)   # `_mlp` is TRAIN's model at depth 1

def test_readonly_dir_for_a_new_store_is_refused_clearly(tmp_path):
    d = tmp_path/'ro'
    d.mkdir()
    model = _mlp()
    with read_only(d):
        with pytest.raises((StoreError, OSError)) as ei:
            torchEmber(model, run='r', db=d/'store.db')
    assert str(d/'store.db') in str(ei.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())   # not left armed
    assert 'disarm' not in vars(model)

def test_readonly_store_file_is_refused_with_a_store_error(tmp_path):
    "StoreError's docstring: 'a store that cannot be used: not a database, a newer schema, or not writable'."
    d, f = _closed_store(tmp_path, 'rofile')
    model = _mlp()
    with read_only(f):
        with pytest.raises(StoreError, match=str(f)):
            torchEmber(model, run='new', db=f)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

def test_readonly_store_file_can_be_read(tmp_path):
    d, f = _closed_store(tmp_path, 'rofile-read')
    with read_only(f):
        assert runs(f)['name'].tolist() == ['archived']
        assert len(load('archived', f).df()) == ARCHIVED_ROWS

def test_readonly_store_in_readonly_dir_can_be_read(tmp_path):
    "A WAL store in a folder we cannot write (no -shm can be made) is read as an immutable file; writing to it is refused."
    d, f = _closed_store(tmp_path, 'rodir')
    with read_only(f, d):
        assert runs(f)['name'].tolist() == ['archived']
        assert len(load('archived', f).df()) == ARCHIVED_ROWS
        model = _mlp()
        with pytest.raises(StoreError, match='store.db'): torchEmber(model, run='new', db=f)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------- a finished step is stored, pause or none (issue 47)

PAUSING = textwrap.dedent('''
    import sys, time
    import torch
    from torch import nn
    from torchember import torchEmber
    db, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    te = torchEmber(model, run='r', db=db)
    for step in range(10):
        if mode == 'eval':                       # no backward due: finished as its forward ends
            with torch.no_grad(): model(torch.randn(16, 16))
        else:
            loss = model(torch.randn(16, 16)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            if mode == 'log': te.log(loss=loss)  # after the backward, before the pause: in its step
        print(step, time.time(), flush=True)
    print('pause', time.time(), flush=True)
    time.sleep(60)                               # an evaluation, a checkpoint: killed during it
''')

@pytest.mark.parametrize('mode', ['train', 'eval', 'log'])
def test_a_step_finished_before_a_pause_survives_kill_9(tmp_path, mode):
    "The last step before a pause is closed by the closer thread and written: `kill -9` 1.5 s into the pause loses nothing."
    db = tmp_path/'pause.db'
    p = subprocess.Popen([sys.executable, script(tmp_path, PAUSING, 'pause.py'), str(db), mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env())
    try:
        for line in p.stdout:
            if line.startswith('pause'): break
        time.sleep(1.5)
    finally:
        p.kill()
        _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err[-3000:]
    assert sql(str(db), "SELECT step FROM steps ORDER BY step") == [(s,) for s in range(10)], "a finished step was lost"
    if mode == 'log': assert sql(str(db), "SELECT count(*) FROM scalars WHERE name = 'loss'") == [(10,)]

def _wait_written(db, run, steps, within=1.0):
    "The steps of `run` stored once `within` s have passed (the README's bound for a finished step)."
    time.sleep(within)
    return [s for s in _stored_steps(db, run) if s in steps]

def _stored_steps(db, run):
    return [s for (s,) in sql(db, f"SELECT s.step FROM steps s JOIN runs r ON r.id = s.run_id WHERE r.name = '{run}' ORDER BY s.step")]

def test_accumulated_grads_stay_with_the_latest_forward_and_close_it(db):
    "Two forwards, one backward: the first step closes at the second call, the second waits for the backward's grads."
    model = _mlp()
    te = torchEmber(model, run='acc', db=db)
    x = torch.randn(4, 8)
    out = model(x) + model(x)                    # steps 0 and 1; the backward is still due
    assert _wait_written(db, 'acc', [0, 1]) == [0], "a step was written before its backward"
    out.sum().backward()                         # the grads are step 1's
    assert _wait_written(db, 'acc', [0, 1]) == [0, 1], "a finished step was not written within a second"
    df = te.df()
    assert set(df[df.ttype == 'weight_grad'].step) == {1}
    te.disarm()

def test_grads_after_the_closer_closed_a_step_are_kept_as_late_rows(db):
    "A second backward of a step the closer has closed: its grads come as late rows, and nothing raises."
    model = _mlp()
    te = torchEmber(model, run='late', db=db, io_grad=True, timing=True)
    out = model(torch.randn(4, 8))
    out.sum().backward(retain_graph=True)
    assert _wait_written(db, 'late', [0]) == [0]
    out.sum().backward()                         # its io_grad hooks are still on the tensors: they take the step back
    te.log(after=1.0)                            # a scalar for a closed step: stored as a late row too
    te.flush()
    assert sql(db, "SELECT count(*) FROM scalars WHERE name = 'after'") == [(1,)]
    model(torch.randn(4, 8)).sum().backward()    # the next step as usual
    te.disarm()
    assert _stored_steps(db, 'late') == [0, 1]
    assert not out._backward_hooks, "a tensor hook of the closed step outlived disarming"


# ---------------------------------------------------------------- a slow stat is named once (issue 47)

@pytest.mark.parametrize('ttype', ['input', 'output', 'weight', 'weight_grad'])
def test_a_slow_stat_is_named_once_whatever_its_ttype_and_the_pauses(db, ttype):
    "A stat function taking 0.1 s a call on several tensors a step is named once, in a loop that pauses 1 s between steps."
    def slow(t):
        time.sleep(0.1)
        return {'m': t.float().mean()}
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1))   # 3+ tensors of every ttype
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(model, run='slow', db=db)
        te.how_record(ttype, slow)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            time.sleep(1)                        # data loading, an evaluation: not the step's time
        te.disarm()
    named = [m for m in tw(rec) if "stat function 'slow' took" in m]
    assert len(named) == 1, tw(rec)
    assert 'fewer tensors' in named[0] and '% of it' in named[0]

def test_a_fork_while_the_closer_holds_its_lock_leaves_the_child_free(db):
    "A DataLoader worker forked while a capture's lock is held (the closer closing a step) runs the model, never hangs."
    model = _mlp()
    te = torchEmber(model, run='fork', db=db)
    model(torch.randn(4, 8)).sum().backward()    # finished: marked for the closer
    cap, held, go = te.capture, threading.Event(), threading.Event()
    def hold():
        with cap._lock: held.set(); go.wait(10)
    t = threading.Thread(target=hold)
    t.start(); held.wait()
    pid = os.fork()
    if pid == 0:                                 # the child: the parent's model, inert, takes its step back first
        try: model(torch.randn(4, 8)); os._exit(0)
        except BaseException: os._exit(1)
    go.set(); t.join()
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done: break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
        pytest.fail("the forked child hung on a lock held at the fork")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    te.disarm()
