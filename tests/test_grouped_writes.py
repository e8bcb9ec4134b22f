"The writer puts the steps it finds waiting into one transaction; a step that cannot be written is the only one lost."
import threading, warnings
import pytest, torch
from torch import nn
from sqlalchemy import event
import torchember.ember as ember
import torchember.store.writer as writer
from torchember import torchEmber

pytestmark = pytest.mark.usefixtures('thread_writer', 'unpaced')   # they watch or patch the writer's work here

@pytest.fixture
def unpaced(monkeypatch):
    "Let every write take a whole group: these tests count transactions, and a loaded machine must not change them."
    # the writer takes fewer steps a write where its last writes say a group would outlast `TXN_S`; step 0's first
    # write to PostgreSQL takes about 13 ms alone, past `TXN_S / GROUP` under CI's load (test_writer_bounded tests that)
    monkeypatch.setattr(writer, 'TXN_S', 3600.)


class Branchy(nn.Module):
    "Two linears; `skip` leaves the second out, so a step's enter/exit events change."
    def __init__(self):
        super().__init__()
        self.a, self.b, self.skip = nn.Linear(4, 4), nn.Linear(4, 4), False
    def forward(self, x): return self.a(x) if self.skip else self.b(self.a(x))

def _step(model): model(torch.randn(2, 4)).sum().backward()

class _held:
    "Keep `te`'s writer from taking steps until `set()`, so that the steps closed meanwhile wait in its queue."
    def __init__(self, te):
        self.w = te.writer
        self.w._cv.acquire()              # the writer takes steps under this lock
    def set(self): self.w._cv.release()

def _commits(te):
    n = []
    event.listen(te.engine, 'commit', lambda conn: n.append(1))
    return n

def _fail_step(monkeypatch, te, bad):
    "Make writing step `bad` fail, in a transaction of several steps and in one of its own (the writer's `write`)."
    real = te.writer.write   # `store.write_steps` bound to the run, or the writer process
    def write(steps):
        if any(s['step'] == bad for s in steps): raise OSError(f"step {bad} cannot be written")
        return real(steps)
    monkeypatch.setattr(te.writer, 'write', write)

def _stored_steps(te): return sorted(set(te.df().step))


def test_waiting_steps_are_written_in_one_transaction(store):
    model = Branchy()
    te = torchEmber(model, run='group', db=store)
    _step(model); te.flush()                      # step 0 written; the writer exists
    gate, commits = _held(te), _commits(te)
    for _ in range(5): _step(model)               # steps 1-5
    te.capture.close()                            # step 5 closes now (else at the next step or flush)
    gate.set(); te.flush()
    assert len(commits) == 1
    assert _stored_steps(te) == [0, 1, 2, 3, 4, 5]
    assert all(te.sequence(s) == te.sequence(0) for s in range(1, 6))
    te.disarm()

def test_more_steps_than_a_group_take_several_transactions(store):
    model = Branchy()
    te = torchEmber(model, run='groups', db=store)
    _step(model); te.flush()
    gate, commits = _held(te), _commits(te)
    n = ember.GROUP + 3
    for _ in range(n): _step(model)
    te.capture.close()
    gate.set(); te.flush()
    assert len(commits) == 2
    assert _stored_steps(te) == list(range(n + 1))
    te.disarm()

def test_a_step_that_fails_is_the_only_one_lost_and_later_steps_keep_their_events(store, monkeypatch):
    model = Branchy()
    te = torchEmber(model, run='lose-one', db=store)
    _step(model); te.flush()                      # step 0: a -> b
    full = te.sequence(0)
    gate = _held(te)
    model.skip = True
    for _ in range(3): _step(model)               # steps 1-3: a alone; step 1 would be the one to write these events
    te.capture.close()
    _fail_step(monkeypatch, te, 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        gate.set(); te.flush()
    assert sum('records of this step are lost' in str(x.message) for x in w) == 1
    assert _stored_steps(te) == [0, 2, 3]
    assert te.sequence(0) == full
    short = te.sequence(2)
    assert short and short != full and te.sequence(3) == short, "step 2 must carry the events step 1 failed to write"
    te.disarm()

def test_snapshot_of_a_failed_step_is_saved_by_the_next_step_that_has_it(store, monkeypatch):
    model = Branchy()
    te = torchEmber(model, run='snap-one', db=store, snapshot='a.weight')
    _step(model); te.flush()
    gate = _held(te)
    with torch.no_grad(): model.a.weight.add_(1.0)   # steps 1-3 see these weights (no optimizer: nothing else moves them)
    for _ in range(3): _step(model)
    te.capture.close()
    _fail_step(monkeypatch, te, 1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        gate.set(); te.flush()
    snaps = te.run.snapshots()
    assert sorted(snaps.step) == [0, 2], "the changed weight must be saved at step 2 once step 1 is lost, and only once"
    assert torch.equal(te.run.snapshot('a', 'weight', step=2), model.a.weight.detach())
    te.disarm()

def test_strict_raises_the_failed_write_from_flush(store, monkeypatch):
    model = Branchy()
    te = torchEmber(model, run='strict-one', db=store, strict=True)
    _step(model); te.flush()
    gate = _held(te)
    for _ in range(3): _step(model)
    te.capture.close()
    _fail_step(monkeypatch, te, 2)
    gate.set()
    with pytest.raises(OSError, match="step 2 cannot be written"): te.flush()
    assert _stored_steps(te) == [0, 1, 3]
    te.disarm()
