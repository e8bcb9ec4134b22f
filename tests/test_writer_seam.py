"""The writer calls the store, not back into `ember` (issue 49): a `torchEmber`'s writer thread turns the step records
into `write_steps`' arguments with the `prepare` it was given (`StepArgs`), writes them with the store's `write_steps`
(or hands them to the writer process), and tells the layers above what it wrote through its `on_written` listener."""
import inspect
import pytest, torch
from torch import nn
import torchember.ember as E
from torchember import torchEmber
from torchember.store import write_steps

def _train(te, model, steps=3):
    for _ in range(steps): model(torch.randn(4, 3)).sum().backward()
    te.flush()

def test_the_writer_thread_calls_the_store_directly(db, thread_writer, monkeypatch):
    "No frame of `torchember.ember` stands between the writer thread and `write_steps`; ember hears of it afterwards."
    stacks, told = [], []
    def spied(*a, **k):
        stacks.append([f.frame.f_globals.get('__name__') for f in inspect.stack()[1:]])
        return write_steps(*a, **k)
    monkeypatch.setattr(E, 'write_steps', spied)          # what `_start_writer` hands the writer
    model = nn.Linear(3, 2)
    with torchEmber(model, run='seam', db=db) as te:
        heard = te._on_written
        te.writer.on_written = lambda args: told.append([a['step'] for a in args]) or heard(args)
        _train(te, model)
        assert isinstance(te.writer.prepare, E.StepArgs)
    assert stacks and all(s[0] == 'torchember.store.writer' and 'torchember.ember' not in s for s in stacks), stacks
    assert sorted(s for steps in told for s in steps) == [0, 1, 2]
    assert te.run.df()['step'].nunique() == 3

def test_a_failed_write_puts_back_what_its_steps_moved_on(db, thread_writer):
    "A transaction that fails undoes what `StepArgs` moved on (the last events written), so the next step writes its own."
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    with torchEmber(model, run='undo', db=db) as te:
        write, fails = te.writer.write, [1]
        def once(args):
            if fails: fails.pop(); raise RuntimeError('refused once')
            return write(args)
        te.writer.write = once
        with pytest.warns(RuntimeWarning, match='refused once'): _train(te, model, 1)   # step 0 lost, its events too
        assert te.writer.prepare.last_events == (None, None)
        _train(te, model, 2)
    with te.engine.connect() as c:
        rows = c.exec_driver_sql('SELECT step, events_step FROM steps WHERE run_id = ? ORDER BY step', (te.run_id,)).all()
    assert [tuple(r) for r in rows] == [(1, 1), (2, 1)]   # step 1 holds the events step 0 never stored; step 2 points at them
