"The model as a graph (issue 28): which leaf module's output feeds which one's input, captured on one step, changing nothing."
import copy, dataclasses, warnings
from collections import namedtuple

import pytest, torch
from torch import nn
from corpus import CORPUS, loss_of, train_step
from test_corpus import flat
from torchember import torchEmber, load
from torchember.graph import Flows, GraphCapture, ENDS, MAX_CAPTURES
from torchember.query import GRAPH_ENDS


def graph_of(model, db, *args, steps=1, run='g', **kwargs):
    "Arm `model`, run `steps` training steps on `args`/`kwargs`, and return the run's graph as a set of edges, and the frame."
    with torchEmber(model, run=run, db=db) as te:
        for _ in range(steps): loss_of(model(*args, **kwargs)).backward()
    g = te.run.graph()
    return {(s, d) for s, d in zip(g.src, g.dst)}, g


# ---------------------------------------------------------------- hand-written expectations

class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    def forward(self, x):
        h = self.inp(x)
        h = h + self.attn(h)
        return self.out(h.relu())

def test_residual(db):
    edges, g = graph_of(Residual(), db, torch.randn(3, 4))
    assert edges == {('<input>', 'inp'), ('inp', 'attn'), ('inp', 'out'), ('attn', 'out'), ('out', '<output>')}
    assert (g.calls == 1).all() and (g.dst_calls == 1).all()

class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b, self.fc = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(4, 2), nn.Linear(5, 1)
    def forward(self, x):
        t = self.trunk(x).view(x.shape[0], -1)
        return self.fc(torch.cat([self.a(t), self.b(t)[:, :2]], dim=1))

def test_branch(db):
    edges, _ = graph_of(Branch(), db, torch.randn(3, 4))
    assert edges == {('<input>', 'trunk'), ('trunk', 'a'), ('trunk', 'b'), ('a', 'fc'), ('b', 'fc'), ('fc', '<output>')}

class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
    def forward(self, x):
        for _ in range(3): x = torch.tanh(self.block(x))
        return self.head(x)

def test_loop_is_one_node_with_an_edge_to_itself(db):
    edges, g = graph_of(Loop(), db, torch.randn(3, 4))
    assert edges == {('<input>', 'block'), ('block', 'block'), ('block', 'head'), ('head', '<output>')}
    rows = g.set_index(['src', 'dst'])
    assert rows.loc[('block', 'block')].tolist() == [2, 3]      # calls of block fed by block, all calls of block
    assert rows.loc[('<input>', 'block')].tolist() == [1, 3]

class Mix(nn.Module):
    "A leaf whose forward takes keyword tensors."
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
    def forward(self, x, *, gate=None, bias=None): return x * self.w * torch.sigmoid(gate) + bias

class Kwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.q, self.mix = nn.Linear(4, 4), nn.Linear(4, 4), Mix()
    def forward(self, x, *, extra):
        return self.mix(self.p(x), gate=self.q(x), bias=extra)

def test_keyword_tensors(db):
    edges, _ = graph_of(Kwargs(), db, torch.randn(3, 4), extra=torch.randn(3, 4))
    assert edges == {('<input>', 'p'), ('<input>', 'q'), ('p', 'mix'), ('q', 'mix'), ('<input>', 'mix'), ('mix', '<output>')}

Pair = namedtuple('Pair', ['left', 'right'])

@dataclasses.dataclass
class Out:
    left: torch.Tensor
    right: torch.Tensor

class Split(nn.Module):
    "A leaf returning a dict, a namedtuple or a dataclass of two tensors."
    def __init__(self, kind):
        super().__init__()
        self.kind, self.w = kind, nn.Parameter(torch.ones(4))
    def forward(self, x):
        l, r = x * self.w, x - self.w
        return {'left': l, 'right': r} if self.kind == 'dict' else Pair(l, r) if self.kind == 'namedtuple' else Out(l, r)

class Fields(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.split, self.l, self.r, self.fc = Split(kind), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    def forward(self, x):
        s = self.split(x)
        left, right = (s['left'], s['right']) if isinstance(s, dict) else (s.left, s.right)
        return Pair(self.fc(self.l(left)), self.r(right))      # a namedtuple out of the root too

@pytest.mark.parametrize('kind', ['dict', 'namedtuple', 'dataclass'])
def test_structured_outputs_feed_different_modules(kind, db):
    edges, _ = graph_of(Fields(kind), db, torch.randn(3, 4))
    assert edges == {('<input>', 'split'), ('split', 'l'), ('split', 'r'), ('l', 'fc'), ('fc', '<output>'), ('r', '<output>')}

class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.shared, self.dec = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    def forward(self, x, y):
        return self.dec(self.shared(self.enc(x)) + self.shared(y))

def test_shared_module_is_one_node(db):
    edges, g = graph_of(Shared(), db, torch.randn(3, 4), torch.randn(3, 4))
    assert edges == {('<input>', 'enc'), ('<input>', 'shared'), ('enc', 'shared'), ('shared', 'dec'), ('dec', '<output>')}
    assert set(g[g.dst == 'shared'].dst_calls) == {2}
    assert g.set_index(['src', 'dst']).loc[('shared', 'dec'), 'calls'] == 1   # one call of dec, fed by both calls of shared

class DataDependent(nn.Module):
    "Control flow on values: torch.fx cannot trace it."
    def __init__(self):
        super().__init__()
        self.a, self.pos, self.neg = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)
    def forward(self, x):
        h = self.a(x)
        return self.pos(h) if h.sum() > 0 else self.neg(h)

def test_data_dependent_control_flow(db):
    m = DataDependent()
    with pytest.raises(Exception): torch.fx.symbolic_trace(m)
    x = torch.randn(3, 4)
    taken = 'pos' if m.a(x).sum() > 0 else 'neg'
    edges, _ = graph_of(m, db, x)
    assert edges == {('<input>', 'a'), ('a', taken), (taken, '<output>')}

class Positions(nn.Module):
    "An embedding of `torch.arange`: its call is fed by no module and no input."
    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(10, 4), nn.Embedding(8, 4), nn.Linear(4, 1)
    def forward(self, ids):
        return self.fc(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))

def test_const_sources(db):
    edges, _ = graph_of(Positions(), db, torch.randint(0, 10, (2, 8)))
    assert edges == {('<input>', 'tok'), ('<const>', 'pos'), ('tok', 'fc'), ('pos', 'fc'), ('fc', '<output>')}

class InPlace(nn.Module):
    "In-place ops outside modules: `out += identity` and `x[:, :2] = ...`."
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.fc = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 1)
    def forward(self, x):
        out = self.a(x)
        out += self.b(x)
        buf = torch.zeros_like(out)
        buf[:, :2] = self.c(x)
        return self.fc(out * buf)

def test_in_place_ops(db):
    edges, _ = graph_of(InPlace(), db, torch.randn(3, 4))
    assert edges == {('<input>', 'a'), ('<input>', 'b'), ('<input>', 'c'), ('a', 'fc'), ('b', 'fc'), ('c', 'fc'), ('fc', '<output>')}

def test_leaf_root(db):
    edges, _ = graph_of(nn.Linear(4, 2), db, torch.randn(3, 4))
    assert edges == {('<input>', ''), ('', '<output>')}

def test_reader_names_the_ends_as_stored():
    assert GRAPH_ENDS == ENDS


# ---------------------------------------------------------------- when it captures

class Growing(nn.Module):
    "Calls `extra` once `more` is set: its call sequence changes."
    def __init__(self):
        super().__init__()
        self.a, self.extra, self.more = nn.Linear(4, 4), nn.Linear(4, 4), False
    def forward(self, x):
        h = self.a(x)
        return self.extra(h) if self.more else h

def test_captures_once_then_on_a_new_sequence(db):
    m = Growing()
    te = torchEmber(m, run='grow', db=db)
    for step in range(8):
        m.more = step >= 4
        m(torch.randn(2, 4)).sum().backward()
        if step == 2: assert not m._forward_hooks or len(m._forward_hooks) == 1   # no graph hook waits on steps 1..3
    te.disarm()
    with te.engine.connect() as c: steps = c.exec_driver_sql('SELECT DISTINCT step FROM flows ORDER BY step').scalars().all()
    assert steps == [0, 6]     # step 0, and two steps after the change at step 4
    r = load('grow', db)
    assert set(r.graph(step=3).dst) == {'a', '<output>'}
    assert set(r.graph().dst) == {'a', 'extra', '<output>'}

def test_waits_for_a_step_with_grad(db):
    m = Residual()
    te = torchEmber(m, run='nograd', db=db)
    with torch.no_grad(): m(torch.randn(2, 4))
    m(torch.randn(2, 4)).sum().backward()
    te.disarm()
    assert te.run.graph().attrs['step'] == 1

def test_every_n(db):
    m = Residual()
    te = torchEmber(m, run='every', db=db, every=3)
    for _ in range(5): m(torch.randn(2, 4)).sum().backward()
    te.disarm()
    assert te.run.graph().attrs['step'] == 0

def test_gives_up_with_one_warning_and_changes_nothing(db, monkeypatch):
    def broken(self, *args): raise RuntimeError('bookkeeping')
    monkeypatch.setattr(Flows, 'op', broken)
    m, x = Residual(), torch.randn(3, 4)
    bare = copy.deepcopy(m)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(m, run='broken', db=db)
        for _ in range(3): assert torch.equal(m(x), bare(x))
        te.disarm()
    said = [str(w.message) for w in rec if 'data flow' in str(w.message)]
    assert len(said) == 1 and 'bookkeeping' in said[0]
    assert te.run.graph().empty
    assert not m._forward_hooks and not m._forward_pre_hooks and not m.inp._forward_pre_hooks

def test_never_raises_into_the_forward_with_warnings_as_errors(db, monkeypatch):
    monkeypatch.setattr(Flows, 'enter', lambda *a: 1 / 0)
    m, x = Residual(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        te = torchEmber(m, run='strict', db=db)
        m(x).sum().backward()
        te.disarm()


# ---------------------------------------------------------------- the corpus

@pytest.mark.parametrize('name', list(CORPUS))
def test_corpus(name, db):
    "Every leaf called is fed by something; every edge goes forward in time (that capture changes no output or grad: test_corpus.py)."
    model, make_batch = CORPUS[name]()
    te = torchEmber(model, run=name, db=db)
    for step in range(2): train_step(model, make_batch(step), step)
    te.disarm()
    r = load(name, db)
    g = r.graph()
    assert g.attrs['step'] == 0 and len(g)
    seq = r.sequence(0)
    entered = [s.split(' ', 1)[1] for s in seq if s.startswith('enter ')]
    first = {n: entered.index(n) for n in entered}
    last = {n: len(entered) - 1 - entered[::-1].index(n) for n in entered}
    has_children = {n.rpartition('.')[0] for n, _ in model.named_modules() if n}
    leaves_called = {n for n in entered if n not in has_children}
    assert leaves_called <= set(g.dst), leaves_called - set(g.dst)
    assert '<output>' in set(g.dst)
    for s, d in zip(g.src, g.dst):
        if s in ENDS.values() or d in ENDS.values(): continue
        assert first[s] < last[d] or s == d, (s, d)
