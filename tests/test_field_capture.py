"""Field-proof capture (issue 17, items 1, 4-8): arming holds in the setups people train in.

Inference mode (Lightning's validation), tensor hooks on long-lived leaves (parametrizations), backward times of
containers, activation checkpointing, copies of an armed model, and torch.compile.
"""
import copy, gc, io, os, pickle, subprocess, sys, textwrap, uuid, warnings

import pytest, torch
from torch import nn

from torchember import torchEmber


def run_name(): return f"r-{uuid.uuid4().hex[:10]}"

def tw(rec):
    "The torchember warnings among `rec` (a `catch_warnings(record=True)` list)."
    return [str(w.message) for w in rec if str(w.message).startswith('torchember')]

def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor): assert torch.equal(a, b)
    else: assert a == b


# ---------------------------------------------------------------- 1. torch.inference_mode

def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.ReLU(inplace=True), nn.Linear(8, 2))

def _linear():
    torch.manual_seed(0)
    return nn.Linear(4, 2)

OPTIONS = {'default': {}, 'all': dict(timing=True, io_grad=True, hist=4, track_updates=True, snapshot='*')}

@pytest.mark.parametrize('opts', OPTIONS)
@pytest.mark.parametrize('make', [_linear, _bn_model], ids=['linear', 'bn_dropout'])
@pytest.mark.parametrize('mode', ['train', 'eval'])
def test_inference_mode_runs_unchanged_and_records_eval_calls(db, make, mode, opts):
    model = make()
    bare = copy.deepcopy(model)
    model.train(mode == 'train'); bare.train(mode == 'train')
    te = torchEmber(model, run=run_name(), db=db, **OPTIONS[opts])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    for i in range(3):
        with torch.inference_mode():
            torch.manual_seed(i); ya = model(x)
            torch.manual_seed(i); yb = bare(x)
        assert ya.is_inference() and torch.equal(ya, yb)
        torch.manual_seed(i); model(x).sum().backward()           # a training call between inference calls
        torch.manual_seed(i); bare(x).sum().backward()
    for a, b in zip(bare.state_dict().values(), model.state_dict().values()): assert torch.equal(a, b)   # BN's running stats
    for a, b in zip(bare.parameters(), model.parameters()): assert torch.equal(a.grad, b.grad)
    steps = te.flush().run.steps()
    assert len(steps) == 6
    assert steps.training.tolist() == [False, mode == 'train'] * 3   # inference calls are eval calls
    df = te.df()
    assert df.groupby('step').size().nunique() <= 2 and set(df.step) == set(range(6))
    assert df[df.ttype == 'output']['mean'].notna().all()
    te.disarm()

def test_inference_mode_calls_are_skipped_without_record_eval(db):
    model = _bn_model()
    te = torchEmber(model, run=run_name(), db=db, record_eval=False)
    for _ in range(2):
        with torch.inference_mode(): model(torch.randn(3, 4))
        model(torch.randn(3, 4)).sum().backward()
    steps = te.flush().run.steps()
    assert steps.step.tolist() == [0, 1] and steps.training.all()
    te.disarm()

def test_inference_mode_inside_a_training_forward(db):
    "A module that runs part of its forward under inference mode (a frozen teacher): recorded, nothing breaks."
    class Teacher(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        def forward(self, x):
            with torch.inference_mode(): t = self.frozen(x)
            return self.head(t.clone())
    torch.manual_seed(0)
    model = Teacher(); bare = copy.deepcopy(model)
    te = torchEmber(model, run=run_name(), db=db, timing=True, io_grad=True)
    x = torch.randn(3, 4)
    ya, yb = model(x), bare(x)
    assert torch.equal(ya, yb)
    ya.sum().backward(); yb.sum().backward()
    assert torch.equal(model.head.weight.grad, bare.head.weight.grad)
    df = te.df()
    assert {'frozen', 'head', ''} <= set(df.module)
    te.disarm()

def test_no_grad_calls_still_record_their_mode(db):
    model = _bn_model()
    te = torchEmber(model, run=run_name(), db=db, timing=True, io_grad=True)
    with torch.no_grad(): model(torch.randn(3, 4))
    model.eval()
    with torch.no_grad(): model(torch.randn(3, 4))
    steps = te.flush().run.steps()
    assert steps.training.tolist() == [True, False]
    assert all(not p._backward_hooks for p in model.parameters())   # no tensor hook where no backward can come
    te.disarm()
