"Findings as they happen: the writer's detectors, `on_finding`, and `stop_on` stopping training, with either writer."
import time, warnings
from collections import OrderedDict
import pytest
import torch
from torch import nn
from torchember import torchEmber, load
from torchember.ember import TrainingStopped

NAN_AT = 7   # the step at which `Bomb` makes NaN

class Bomb(nn.Module):
    "Passes its input on, except at its `at`-th call, where it returns NaN."
    def __init__(self, at=NAN_AT):
        super().__init__()
        self.at, self.calls = at, 0
    def forward(self, x):
        self.calls += 1
        return x * float('nan') if self.calls == self.at + 1 else x

def make_model(bomb=True):
    torch.manual_seed(0)
    layers = [('fc1', nn.Linear(4, 16)), ('act', nn.Tanh())]
    if bomb: layers.append(('bomb', Bomb()))
    return nn.Sequential(OrderedDict(layers + [('fc2', nn.Linear(16, 1))]))

def train(model, steps, te=None, pause=0.0):
    "Train `steps` steps (seeded data); the losses, and how many steps ran before `TrainingStopped` (re-raised)."
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g, losses = torch.Generator().manual_seed(1), []
    for i in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
        if pause: time.sleep(pause)
    return losses

@pytest.fixture(params=['thread', 'process'])
def writer(request, monkeypatch):
    monkeypatch.setenv('TORCHEMBER_WRITER', request.param)
    return request.param

def test_stop_on_nonfinite_names_step_iteration_and_module(db, writer):
    model = make_model()
    te = torchEmber(model, run='nan', db=db, stop_on=['nonfinite', 'spike'])
    assert (te.writer_process is not None) == (writer == 'process')
    seen = []
    te.on_finding(seen.append)
    with pytest.raises(TrainingStopped) as e: train(model, 3000, pause=0.002)
    stopped_at = te.capture.step            # the steps recorded before the one that did not start
    f = e.value.finding
    assert (f.kind, f.step, f.iteration, f.module, f.ttype) == ('nonfinite', NAN_AT, NAN_AT, 'bomb', 'output')
    msg = str(e.value)
    said = (f"nonfinite at step {NAN_AT}", f"iteration {NAN_AT}", "module 'bomb'",
            "torchember doctor nan", "torchember serve")
    for words in said:
        assert words in msg, (words, msg)
    assert stopped_at > NAN_AT
    assert [(s.kind, s.step, s.module) for s in seen][:1] == [('nonfinite', NAN_AT, 'bomb')]
    r = load('nan', db)                      # each step recorded before the exception was stored as it was raised
    assert r.steps()['step'].tolist() == list(range(stopped_at + 1))
    assert r.first_nonfinite()['module'] == 'bomb' and r.first_nonfinite()['step'] == NAN_AT
    te.disarm()

def test_training_can_go_on_after_a_stop(db, writer):
    "Caught, the stop is not raised again for the same finding; the model trains on, recorded."
    model = make_model()
    te = torchEmber(model, run='on', db=db, stop_on='nonfinite')
    with pytest.raises(TrainingStopped): train(model, 3000, pause=0.002)
    before = te.capture.step
    train(model, 5)
    assert te.flush().run.n_steps == before + 1 + 5
    te.disarm()

def test_bare_training_unchanged_where_nothing_fires(db, writer):
    bare = train(make_model(bomb=False), 40)
    model = make_model(bomb=False)
    seen = []
    with torchEmber(model, run='clean', db=db, stop_on=['nonfinite', 'spike', 'dead']) as te:
        te.on_finding(seen.append)
        losses = train(model, 40)
    assert losses == bare                    # bit for bit
    assert seen == [] and te.live_findings == []
    assert te.run.n_steps == 40
    assert model._forward_pre_hooks == {}    # the stop hook is gone with the rest

def test_on_finding_exception_is_warned_never_raised(db, thread_writer):
    model = make_model()
    te = torchEmber(model, run='raises', db=db)
    def broken(f): raise ValueError('my callback is broken')
    te.on_finding(broken)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        losses = train(model, 12)
        te.flush()
    assert len(losses) == 12                 # training never saw it
    assert [f.kind for f in te.live_findings] == ['nonfinite']
    assert any("'broken' raised ValueError: my callback is broken" in str(w.message) for w in said)
    te.disarm()

def test_spike_and_dead_layer_found_live(db, writer):
    "A grad-norm spike (the loss scaled 1000x at one step) and a ReLU whose bias pushed it dead."
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict([('fc1', nn.Linear(4, 16)), ('act', nn.ReLU()), ('fc2', nn.Linear(16, 1))]))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    seen = []
    with torchEmber(model, run='spiky', db=db) as te:
        te.on_finding(seen.append)
        for i in range(40):
            if i == 30:
                with torch.no_grad(): model.fc1.bias.fill_(-100.)    # every unit of `act` below 0 from here on
            loss = model(torch.randn(8, 4)).pow(2).mean() * (1000 if i == 25 else 1)
            loss.backward(); opt.step(); opt.zero_grad()
    kinds = {(f.kind, f.step, f.module) for f in seen}
    assert ('spike', 25, None) in kinds, seen
    assert ('dead', 30, 'act') in kinds, seen
    assert not any(f.module in ('', 'fc2') and f.kind == 'dead' for f in seen)   # the container, the layer after

def test_unknown_kind_is_refused_at_construction(db):
    model = make_model()
    said = r"stop_on= takes kinds of finding among 'nonfinite', 'spike', 'dead', not 'nan'"
    with pytest.raises(ValueError, match=said):
        torchEmber(model, db=db, stop_on=['nonfinite', 'nan'])
    with pytest.raises(TypeError, match="stop_on= must be"): torchEmber(model, db=db, stop_on=3)
    assert model._forward_pre_hooks == {}

def test_explorer_lists_a_new_nan_as_it_arrives(db, thread_writer):
    "An explorer following the run (as `serve` does) lists the first NaN's finding once its step is in, not 30 s later."
    from torchember.explore import Explorer
    model = make_model()
    te = torchEmber(model, run='followed', db=db)
    train(model, 3)
    te.flush()
    ex = Explorer(db, run='followed', interval=0.1)
    ex.live_toggle.value = True
    assert not any('nonfinite' in str(o) for o in ex.findings_picker.options)
    train(model, 10)
    te.flush()
    deadline = time.monotonic() + 15
    listed = lambda: any('nonfinite' in str(o) for o in ex.findings_picker.options)
    while not listed() and time.monotonic() < deadline: time.sleep(0.1)
    labels = [str(o[0]) for o in ex.findings_picker.options]
    assert any('nonfinite' in l and f'step {NAN_AT}' in l and 'bomb' in l for l in labels), labels
    ex.stop(); ex.close()
    te.disarm()
