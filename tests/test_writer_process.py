"""The writer process (`torchember.store.writer`, issue 29): a child process writes the store where a core is spare.

Everything the thread promised holds with the process: the same rows; a locked store waited for (in
`test_never_lose.py`, for both writers); a failed write
warned or raised with `strict`; every flushed step whole when the trainer is killed, and every step when it ends
without a flush or is sent SIGTERM; no child left behind (the trainer killed, its DataLoader forked, the run disarmed);
and a child that dies loses nothing. `TORCHEMBER_WRITER=process` chooses the process on any machine.
"""
import os, signal, sqlite3, subprocess, sys, time, warnings

import pytest, torch
from torch.utils.data import DataLoader, TensorDataset
from pandas.testing import assert_frame_equal

from torchember import torchEmber
from torchember.store.writer import WriterProcess, WRITER_ENV, use_process, cores
from test_never_lose import TRAIN, check_whole, kill_after, rows_per_step, script, env, tw, _mlp, _steps

pytestmark = pytest.mark.skipif(os.name != 'posix', reason="the writer process needs POSIX pipes")

@pytest.fixture
def process(monkeypatch):
    monkeypatch.setenv(WRITER_ENV, 'process')

def armed(tmp_path, run, **kw):
    "A fresh MLP armed for `run` in a store of its own, its first step written: the store's path, the model, the torchEmber."
    db, model = str(tmp_path/f'{run}.db'), _mlp()
    te = torchEmber(model, run=run, db=db, **kw)
    _steps(model, 1)
    te.flush()
    return db, model, te

def sink(te) -> WriterProcess:
    "The `WriterProcess` that writes `te`'s steps."
    wp = te.writer_process
    assert isinstance(wp, WriterProcess)
    return wp

def gone(pid:int, timeout=20) -> bool:
    "Whether process `pid` has ended (or is a zombie nobody waits for) within `timeout` s."
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f'/proc/{pid}/stat') as f:
                if f.read().rsplit(')', 1)[1].split()[0] == 'Z': return True
        except FileNotFoundError: return True
        time.sleep(0.05)
    return False


def test_the_choice(monkeypatch):
    "Unset: a process where a core is spare beside torch's threads or a model on a GPU; asked for: a process, never in memory."
    monkeypatch.delenv(WRITER_ENV, raising=False)
    assert use_process('x.db', threads=cores() - 1) and not use_process('x.db', threads=cores())
    assert use_process('x.db', threads=cores(), on_device=True) == (cores() > 1)   # a model on a GPU leaves torch's threads idle
    monkeypatch.setenv(WRITER_ENV, 'process')
    assert use_process('x.db', threads=10**6) and not use_process(':memory:', threads=1)

def test_process_writes_what_the_thread_writes(tmp_path, monkeypatch):
    "The same seeded training recorded by the thread and by the process: equal records, steps and scalars."
    got = {}
    for kind in ('thread', 'process'):
        monkeypatch.setenv(WRITER_ENV, kind)
        model = _mlp()
        te = torchEmber(model, run=kind, db=str(tmp_path/'same.db'), every=2)
        assert (te.writer_process is not None) == (kind == 'process')
        for i in range(20):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean()
            loss.backward()
            te.log(loss=loss)
        if kind == 'process': wp = sink(te)
        te.disarm()
        run = te.run
        got[kind] = (run.df(), run.steps().drop(columns='closed'), run.scalars(), run.sequence())
    assert wp.proc.returncode == 0, "the writer process did not end by itself at disarm"
    for a, b in zip(got['thread'], got['process']):
        if isinstance(a, list): assert a == b
        else: assert_frame_equal(*[x.drop(columns=[c for c in ('run', 'run_id') if c in x]) for x in (a, b)])
    assert len(got['process'][0]) > 0

@pytest.mark.skipif(not os.path.exists('/proc/self/maps'), reason="reads the child's mapped libraries from /proc")
def test_the_child_imports_no_torch(tmp_path, process):
    "The child imports the store and not the package: no torch, no widgets (it starts in tenths of a second, in tens of MB)."
    model = _mlp()
    te = torchEmber(model, run='light', db=str(tmp_path/'light.db'), every=3)
    _steps(model, 40)
    te.flush()
    maps = open(f'/proc/{sink(te).proc.pid}/maps').read()
    assert 'libsqlite3' in maps or '_sqlite3' in maps          # it did write
    assert 'libtorch' not in maps and 'libc10' not in maps
    te.disarm()

def test_a_failed_write_warns_and_with_strict_raises(tmp_path, process):
    "An error in the child (a table dropped under it) comes back: warned once, and with `strict` raised by `flush`."
    for strict in (False, True):
        db, model, te = armed(tmp_path, f'failing{int(strict)}', strict=strict)
        with sqlite3.connect(db) as c: c.execute('DROP TABLE scalars')
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter('always')
            _steps(model, 2)
            te.log(loss=1.0)
            if strict:
                with pytest.raises(Exception, match='no such table'): te.flush()
            else: te.flush()
        if not strict: assert any('no such table' in m for m in tw(rec)), tw(rec)
        assert te.dropped >= 1
        te.disarm()

def test_a_dead_child_loses_nothing(tmp_path, process):
    db, model, te = armed(tmp_path, 'dead')
    _steps(model, 2)
    wp = sink(te)
    with warnings.catch_warnings(record=True) as rec:   # the kill inside: a write in flight as it dies says so here too
        warnings.simplefilter('always')
        wp.proc.kill(); wp.proc.wait()
        _steps(model, 3, seed=1)
        te.flush()
        _steps(model, 2, seed=2)
        te.flush()
    said = tw(rec)
    assert len(said) == 1 and 'written by this process from now on' in said[0], said
    assert te.dropped == 0
    assert check_whole(db, 'dead', len(te.latest())) == list(range(8))
    te.disarm()

def test_forked_dataloader_workers_leave_the_child_alone(tmp_path, process):
    "Forked DataLoader workers (kept alive) hold no end of the child's pipes: the run is written, and the child ends at disarm."
    model = _mlp()
    data = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8, num_workers=2, persistent_workers=True,
                      multiprocessing_context='fork')
    te = torchEmber(model, run='forked', db=str(tmp_path/'forked.db'))
    wp = sink(te)
    for epoch in range(2):
        for (x,) in data: model(x).pow(2).mean().backward()
    te.disarm()
    assert wp.proc.returncode == 0, "the writer process waited on a pipe a forked worker still holds (and was killed)"
    assert check_whole(str(tmp_path/'forked.db'), 'forked', len(te.run.latest())) == list(range(16))
    del data


# ---------------------------------------------------------------- the trainer killed, signalled, or just ending

SHOW_PID = TRAIN.replace("te = torchEmber(model, run=run, db=db, strict=strict)\n",
                         "te = torchEmber(model, run=run, db=db, strict=strict)\n"
                         "print('writer', te.writer_process.proc.pid, flush=True)\n")

def start(tmp_path, db, run, steps, every, **extra):
    assert SHOW_PID != TRAIN
    return subprocess.Popen([sys.executable, script(tmp_path, SHOW_PID), str(db), run, str(steps), str(every)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**{WRITER_ENV: 'process', **extra}),
                            start_new_session=True)

def child_of(p) -> int:
    line = p.stdout.readline().split()
    assert line[:1] == ['writer'], (line, p.stderr.read()[-3000:] if p.poll() is not None else '')
    return int(line[1])

def test_sigkill_keeps_every_flushed_step_and_ends_the_child(tmp_path):
    db = tmp_path/'killed.db'
    p = start(tmp_path, db, 'killed', steps=10**6, every=3)
    child = child_of(p)
    last = kill_after(p, 40)
    assert last >= 40
    assert gone(child), "the writer process outlived a killed trainer"
    steps = check_whole(str(db), 'killed', rows_per_step())
    assert steps == list(range(len(steps))) and steps[-1] >= last

def test_sigterm_to_the_process_group_writes_every_finished_step(tmp_path):
    "A scheduler's SIGTERM reaches trainer and child: the child stays until the trainer's handler has written through it."
    db = tmp_path/'term.db'
    p = start(tmp_path, db, 'term', steps=10**6, every=5)
    child, last = child_of(p), -1
    for line in p.stdout:
        last = int(line)
        if last >= 30: break
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGTERM, p.stderr.read()[-3000:]
    assert gone(child)
    steps = check_whole(str(db), 'term', rows_per_step())
    assert steps == list(range(len(steps))) and steps[-1] >= last

def test_normal_exit_without_flush_keeps_every_step(tmp_path):
    db = tmp_path/'exit.db'
    p = start(tmp_path, db, 'exit', steps=5, every=10**6, TE_NO_DISARM=1)
    child = child_of(p)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert gone(child)
    assert check_whole(str(db), 'exit', rows_per_step()) == [0, 1, 2, 3, 4]
