"An armed model under `torch.compile` (CPU, inductor): no graph break, no recompile, and the rows of an eager armed run."
import contextlib, time, warnings
import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint
from torchember import torchEmber
from corpus import gpt_like

KEYS = ['step', 'module', 'call', 'ttype', 'tname']
STEPS, EVERY, EVAL_AT = 30, 10, 15   # 30 steps recorded every 10; one eval call (a step of its own) after step 15


def gpt():
    model, make = gpt_like(layers=2, d=32, heads=4, vocab=64, seq=16, batch=2)
    return model, lambda s: make(s)[0][0]

def gpt9():   # more blocks than dynamo's recompile_limit (8): one graph must serve them all
    model, make = gpt_like(layers=9, d=16, heads=2, vocab=32, seq=8, batch=2)
    return model, lambda s: make(s)[0][0]

def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4): layers += [nn.Linear(16, 16), nn.GELU()]
    return nn.Sequential(*layers), lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s))

def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return model, lambda s: torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(s))

def whole(m): return torch.compile(m, fullgraph=True)
def autotune(m): return torch.compile(m, fullgraph=True, mode='max-autotune')     # inductor's GEMM templates, tuned
def overhead(m): return torch.compile(m, fullgraph=True, mode='reduce-overhead')  # CUDA graphs; CPU: inductor's code
def method(m): m.compile(fullgraph=True); return m
def blocks(m):
    for b in m.blocks: b.compile(fullgraph=True)
    return m
def eager(m): return m

def train(make, how, tmp, armed=True, steps=STEPS, every=EVERY, backward=contextlib.nullcontext, **kw):
    "Train a fresh `make()` model compiled `how`; its rows, dynamo's graph count after each step, graph breaks, parameters."
    torch._dynamo.reset(); counters.clear()
    model, batch = make()
    db = str(tmp / f'{make.__name__}-{how.__name__}-{armed}-{backward.__name__}.db')
    te = torchEmber(model, run='r', db=db, every=every, **kw) if armed else None
    call = how(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    graphs = []
    with backward(): return _train(te, model, call, batch, opt, graphs, steps)

def _train(te, model, call, batch, opt, graphs, steps):
    "`train`'s loop and what it returns."
    for s in range(steps):
        if s == EVAL_AT:
            model.eval()
            with torch.no_grad(): call(batch(100))
            model.train()
        call(batch(s)).float().square().mean().backward()
        opt.step(); opt.zero_grad()
        graphs.append(counters['stats']['unique_graphs'])
    out = dict(graphs=graphs, breaks=sum(counters['graph_break'].values()), params=[p.detach().clone() for p in model.parameters()])
    if te is not None:
        te.flush()
        out['events'] = te.capture.recorder.last.events   # the eval call's (step 30) or the last recorded step's
        out['df'] = te.df().sort_values(KEYS).reset_index(drop=True)
        te.disarm()
    return out

@pytest.fixture(autouse=True, scope='module')
def _forget_compiled_code():
    "Compiled code of these models' classes does not outlive this module (arming elsewhere would warn of it)."
    yield
    torch._dynamo.reset()

CASES = [(gpt, whole), (gpt9, blocks), (gpt, method), (mlp, whole), (cnn, whole), (gpt, autotune), (mlp, overhead)]

@pytest.fixture(scope='module', params=CASES, ids=lambda c: f'{c[0].__name__}-{c[1].__name__}')
def runs(request, tmp_path_factory):
    make, how = request.param
    tmp = tmp_path_factory.mktemp('compile')
    return dict(armed=train(make, how, tmp), bare=train(make, how, tmp, armed=False), eager=train(make, eager, tmp))

def test_no_graph_break_no_recompile(runs):
    "fullgraph=True did not raise (no break); arming adds no graph, across `every` and a train/eval switch."
    a, b = runs['armed'], runs['bare']
    assert a['breaks'] == b['breaks'] == 0
    assert a['graphs'] == b['graphs']

def test_rows_equal_eager(runs):
    "Every module's input and output rows, every parameter's weight and grad rows, at each recorded step: eager's."
    assert_rows_equal(runs['armed'], runs['eager'])

def assert_rows_equal(armed:dict, eager:dict):
    "The rows and events of a compiled armed run (`train`'s), eager's."
    c, e = armed['df'], eager['df']
    assert sorted(set(c.step)) == sorted(set(e.step)) and len(set(c.step)) == 4   # steps 0, 10, 20 and the eval call's
    assert set(c.ttype) == {'input', 'output', 'weight', 'weight_grad'}
    assert c[KEYS + ['shape', 'dtype']].equals(e[KEYS + ['shape', 'dtype']])
    for col in ['numel', 'mean', 'std', 'min', 'max', 'norm', 'nan_count', 'inf_count']:
        np.testing.assert_allclose(c[col].to_numpy(float), e[col].to_numpy(float), rtol=1e-5, atol=1e-6, err_msg=col)
    assert armed['events'] == eager['events']
    act = c.ttype != 'weight_grad'   # a grad exactly 0 in eager (attention's key bias) is rounding noise compiled
    np.testing.assert_allclose(c.zero_frac[act].to_numpy(float), e.zero_frac[act].to_numpy(float), atol=1e-6)

LEAN = [(gpt, whole), (gpt9, blocks), (gpt, method), (cnn, whole)]

@pytest.mark.parametrize('make,how', LEAN, ids=[f'{m.__name__}-{h.__name__}' for m, h in LEAN])
def test_bare_unrecorded(make, how, tmp_path, monkeypatch):
    "`bare_unrecorded=True`: unrecorded steps run a second graph, compiled once, without the ops; eager's rows, bare's training."
    from torchember.compiled import CompiledHooks
    ran = []   # the step each region's op recorded into
    take_calls = CompiledHooks.take_calls
    def counted(self, *a):
        ran.append(self.cap.step)
        return take_calls(self, *a)
    monkeypatch.setattr(CompiledHooks, 'take_calls', counted)
    lean = train(make, how, tmp_path, bare_unrecorded=True)
    bare, plain = train(make, how, tmp_path, armed=False), train(make, eager, tmp_path)
    assert lean['breaks'] == 0
    added = [x - y for x, y in zip(lean['graphs'], bare['graphs'])]
    assert added[0] == 0 and set(added[1:]) == {1}, added   # the hook-free graph, at step 1; no graph after it
    assert ran and set(ran) == set(lean['df'].step) == {0, 10, 20, 30}, sorted(set(ran))   # no op on other steps
    assert_rows_equal(lean, plain)
    for p, q in zip(lean['params'], bare['params']): assert torch.equal(p, q)

class Poison(nn.Module):
    "NaN above 1.5 and Inf below -1.5: non-finite values to count."
    def forward(self, x): return torch.where(x > 1.5, torch.nan, torch.where(x < -1.5, torch.inf, x))

class Block(nn.Module):
    "Linear and ReLU: a block of a class of the user's (`nn.Sequential`'s own frames are in dynamo's skip list)."
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 16), nn.ReLU()
    def forward(self, x): return self.act(self.fc(x))

@pytest.mark.parametrize('whole_graph', [True, False], ids=['whole', 'blocks'])
def test_bare_unrecorded_counts_nonfinite_in_the_graph(tmp_path, whole_graph):
    "Compiled with `bare_unrecorded=True`, whole or a block, the recorded steps count NaN and Inf (NaN min and max) as eager's rows do."
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), Poison(), Block(), nn.Linear(16, 4))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)) * 3
    dfs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        m = make()
        te = torchEmber(m, run='nan', db=str(tmp_path / f'nan-{compiled}-{whole_graph}.db'), every=2, bare_unrecorded=True)
        call = m
        if compiled and whole_graph: call = torch.compile(m, fullgraph=True)
        elif compiled: m[2].compile(fullgraph=True)
        with torch.no_grad():
            for _ in range(3): call(x)
        te.flush()
        dfs.append(te.df().sort_values(KEYS).reset_index(drop=True))
        te.disarm()
    c, e = dfs
    assert c[KEYS].equals(e[KEYS]) and set(c.step) == {0, 2}
    assert (e.nan_count > 0).any() and (e.inf_count > 0).any()
    for col in ['numel', 'nan_count', 'inf_count', 'mean', 'min', 'max']:
        np.testing.assert_allclose(c[col].to_numpy(float), e[col].to_numpy(float), rtol=1e-6, err_msg=col)

def test_bare_unrecorded_follows_enable_and_every(tmp_path):
    "With `bare_unrecorded`, `disable()`, `enable()` and a new `every` between steps pick the graph of the next step."
    torch._dynamo.reset()
    model, batch = mlp()
    te = torchEmber(model, run='lean', db=str(tmp_path / 'lean.db'), every=2, bare_unrecorded=True)
    call = torch.compile(model, fullgraph=True)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='torchember')   # no step recorded without its modules (`root_call`)
        for s in range(12):
            if s == 3: te.disable()
            if s == 6: te.enable()   # foreseen unrecorded while disabled, then recorded
            if s == 9: te.capture.every = 1   # foreseen unrecorded at every=2, then recorded
            call(batch(s)).square().mean().backward()
    te.flush()
    df = te.df()
    outs = df[df.ttype == 'output'].groupby('step').size()
    assert sorted(set(df.step)) == [0, 2, 6, 8, 9, 10, 11]   # not 4 (disabled); every step from 9
    assert set(outs.index) == set(df.step) and outs.nunique() == 1   # every recorded step has every module's output
    te.disarm()

def test_training_unchanged(runs):
    "The armed compiled model trains exactly as the bare compiled one."
    for p, q in zip(runs['armed']['params'], runs['bare']['params']): assert torch.equal(p, q)


class CkBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    def forward(self, x): return x + checkpoint(self.inner, x, use_reentrant=False)

def checkpointed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), CkBlock(), CkBlock(), nn.Linear(16, 2))
    return model, lambda s: torch.randn(4, 8, generator=torch.Generator().manual_seed(s))

def ck_blocks(m):   # torchtitan's order: each checkpointed block compiled on its own
    for b in (m[1], m[2]): b.compile(fullgraph=True)
    return m

@pytest.mark.parametrize('io_grad', [False, True])
@pytest.mark.parametrize('how', [whole, ck_blocks], ids=['whole', 'blocks'])
def test_checkpoint_recorded_once(tmp_path, io_grad, how):
    "Activation checkpointing under compile, `fullgraph=True`: each call recorded once (the recomputation is not a call), as eager."
    c = train(checkpointed, how, tmp_path, steps=3, every=1, io_grad=io_grad)
    e = train(checkpointed, eager, tmp_path, steps=3, every=1, io_grad=io_grad)
    assert c['breaks'] == 0 and c['graphs'][-1] == c['graphs'][0]
    cd, ed = c['df'], e['df']
    assert not cd.duplicated(KEYS).any()
    assert cd[KEYS].equals(ed[KEYS].reset_index(drop=True)) and c['events'] == e['events']
    assert set(cd.ttype) >= ({'input', 'output', 'output_grad'} if io_grad else {'input', 'output'})
    assert set(cd[cd.ttype == 'output'].module) >= {'1.inner.0', '1.inner.2', '2.inner.1'}   # inside the checkpoints
    np.testing.assert_allclose(cd['norm'].to_numpy(float), ed['norm'].to_numpy(float), rtol=1e-5, atol=1e-6)

def assert_lean_as_eager(make, tmp_path):
    "`make` compiled whole, `bare_unrecorded`, every 2nd of 5 steps: one graph more, each call once, eager's rows, bare's training."
    c = train(make, whole, tmp_path, steps=5, every=2, bare_unrecorded=True)
    e = train(make, eager, tmp_path, steps=5, every=2)
    b = train(make, whole, tmp_path, armed=False, steps=5)
    assert c['breaks'] == 0 and [x - y for x, y in zip(c['graphs'], b['graphs'])] == [0] + [1] * 4
    cd, ed = c['df'], e['df']
    assert set(cd.step) == {0, 2, 4} and not cd.duplicated(KEYS).any()
    assert cd[KEYS].equals(ed[KEYS].reset_index(drop=True)) and c['events'] == e['events']
    np.testing.assert_allclose(cd['norm'].to_numpy(float), ed['norm'].to_numpy(float), rtol=1e-5, atol=1e-6)
    for p, q in zip(c['params'], b['params']): assert torch.equal(p, q)

def test_checkpoint_bare_unrecorded(tmp_path):
    "Activation checkpointing under compile with `bare_unrecorded`: each call once at each recorded step, eager's rows; bare's training."
    assert_lean_as_eager(checkpointed, tmp_path)

region = torch.compiler.nested_compile_region   # torch 2.8 on: a body traced once, its compiled code stamped out

class RegionBlock(nn.Module):
    "A block whose forward is a nested compile region: its children's tensors alias the body's input, or its output."
    def __init__(self, residual=True, ck=False):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.residual, self.ck = residual, ck
    @region
    def forward(self, x):
        y = checkpoint(self.inner, x, use_reentrant=False) if self.ck else self.inner(x)
        return x + y if self.residual else y

class Blocks(nn.Module):
    def __init__(self, blocks, through=None):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 16), nn.ModuleList(blocks), nn.Linear(16, 2)
        self.through = through
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks: x = b(x) if self.through is None else self.through(b, x)
        return self.out(x)

@region
def _through(block, x): return block(x)   # the region is a function around the call: the block's own hooks inside it

def _blocks(blocks, through=None):
    torch.manual_seed(0)
    return Blocks(blocks(), through), lambda s: torch.randn(4, 8, generator=torch.Generator().manual_seed(s))

def regions():   # two bodies; not a reused body followed by another (inductor's backward is wrong there on torch 2.13)
    return _blocks(lambda: [RegionBlock(), RegionBlock(residual=False), RegionBlock(residual=False)])
def region_calls(): return _blocks(lambda: [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)], _through)
def region_ck(): return _blocks(lambda: [RegionBlock(ck=True), RegionBlock(ck=True)])

@pytest.mark.parametrize('io_grad', [False, True])
@pytest.mark.parametrize('make,how', [(regions, whole), (regions, blocks), (region_calls, whole), (region_ck, whole),
                                      (region_ck, blocks)],   # region_calls' blocks compiled bare: "no compiled frames"
                         ids=lambda x: x.__name__)
def test_nested_compile_region(tmp_path, make, how, io_grad):
    "Nested compile regions in an armed model, `fullgraph=True`: no raise, no break, eager's rows, bare's training."
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        c = train(make, how, tmp_path, steps=3, every=1, io_grad=io_grad)
    e = train(make, eager, tmp_path, steps=3, every=1, io_grad=io_grad)
    b = train(make, how, tmp_path, armed=False, steps=3)
    assert c['breaks'] == 0 and c['graphs'] == b['graphs']
    cd, ed = c['df'], e['df']
    said = sum('nested compile region' in str(x.message) for x in w)
    if io_grad:   # dynamo allows no tensor hook in a body: input grads of modules inside one are not recorded, said
        inside = ed.module.str.startswith('blocks.') & ((ed.module.str.count(r'\.') >= 2) | (make is region_calls))
        ed = ed[~(inside & (ed.ttype == 'input_grad'))]
        assert said == 1 and (ed.ttype == 'input_grad').any() and (cd.ttype == 'output_grad').sum() > 9
    else: assert said == 0
    assert not cd.duplicated(KEYS).any() and cd[KEYS].equals(ed[KEYS].reset_index(drop=True))
    assert c['events'] == e['events']
    inside = {'blocks.0.0', 'blocks.1.0'} if make is region_calls else {'blocks.0.inner.0', 'blocks.1.inner.2'}
    assert inside <= set(cd[cd.ttype == 'output'].module)   # modules inside the bodies
    np.testing.assert_allclose(cd['norm'].to_numpy(float), ed['norm'].to_numpy(float), rtol=1e-5, atol=1e-6)
    for p, q in zip(c['params'], b['params']): assert torch.equal(p, q)

def test_nested_compile_region_bare_unrecorded(tmp_path):
    "Nested compile regions, `bare_unrecorded`: eager's rows at each recorded step, one graph more, bare's training."
    assert_lean_as_eager(regions, tmp_path)

def compiled_autograd(): return torch._dynamo.compiled_autograd._enable(torch.compile())   # the backward compiled too

@pytest.mark.parametrize('io_grad', [False, True])
@pytest.mark.parametrize('how', [eager, whole])
def test_compiled_autograd(tmp_path, how, io_grad):
    "Compiled autograd, forward eager or compiled: no raise, no break, no recompile; eager's rows (weight grads too)."
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        c = train(gpt, how, tmp_path, steps=3, every=1, io_grad=io_grad, backward=compiled_autograd)
    e = train(gpt, eager, tmp_path, steps=3, every=1, io_grad=io_grad)
    b = train(gpt, how, tmp_path, armed=False, steps=3, backward=compiled_autograd)
    assert c['breaks'] == 0 and c['graphs'] == b['graphs']
    cd, ed = c['df'], e['df']
    said = sum('compiled autograd' in str(x.message) for x in w)
    if io_grad and how is whole:   # the compiled forward's hooks and taps fail under compiled autograd: left out, said
        inside = (ed.module != '') & ed.ttype.isin(['input_grad', 'output_grad'])
        assert said == 1 and inside.any()
        ed = ed[~inside]
    else: assert said == 0
    assert (cd.ttype == 'weight_grad').sum() == 3 * sum(1 for _ in gpt()[0].parameters())
    assert cd[KEYS].equals(ed[KEYS].reset_index(drop=True)) and c['events'] == e['events']
    np.testing.assert_allclose(cd['norm'].to_numpy(float), ed['norm'].to_numpy(float), rtol=1e-5, atol=1e-6)
    for p, q in zip(c['params'], b['params']):   # a compiled forward's ops change the backward's rounding: 3e-11 here
        if how is eager: assert torch.equal(p, q)
        else: torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)

def test_input_grads_equal_eager(tmp_path):
    "`io_grad=True` under whole-model inductor: the input_grad rows of an eager armed run; training as the bare compiled."
    c = train(mlp, whole, tmp_path, steps=3, every=1, io_grad=True)
    e = train(mlp, eager, tmp_path, steps=3, every=1, io_grad=True)
    b = train(mlp, whole, tmp_path, armed=False, steps=3)
    assert c['breaks'] == 0 and c['graphs'] == b['graphs']
    cg, eg = (d[d.ttype == 'input_grad'].reset_index(drop=True) for d in (c['df'], e['df']))
    assert len(eg) == 3 * 7 and cg[KEYS + ['shape']].equals(eg[KEYS + ['shape']])   # every module but the first, each step
    np.testing.assert_allclose(cg['norm'].to_numpy(float), eg['norm'].to_numpy(float), rtol=1e-5, atol=1e-6)
    for p, q in zip(c['params'], b['params']): assert torch.equal(p, q)

def test_bare_unrecorded_input_grads(tmp_path):
    "`bare_unrecorded` with `io_grad=True` (a grad tap, tensor hooks): eager's input_grad rows at each recorded step."
    c = train(mlp, whole, tmp_path, steps=6, every=2, io_grad=True, bare_unrecorded=True)
    e = train(mlp, eager, tmp_path, steps=6, every=2, io_grad=True)
    b = train(mlp, whole, tmp_path, armed=False, steps=6)
    assert c['breaks'] == 0 and [x - y for x, y in zip(c['graphs'], b['graphs'])] == [0] + [1] * 5
    cg, eg = (d[d.ttype == 'input_grad'].reset_index(drop=True) for d in (c['df'], e['df']))
    assert len(eg) == 3 * 7 and cg[KEYS + ['shape']].equals(eg[KEYS + ['shape']])   # steps 0, 2, 4
    np.testing.assert_allclose(cg['norm'].to_numpy(float), eg['norm'].to_numpy(float), rtol=1e-5, atol=1e-6)
    for p, q in zip(c['params'], b['params']): assert torch.equal(p, q)

def test_second_instance(tmp_path):
    "A second instance of a compiled class, compiled then armed: its inputs and outputs are recorded too."
    first, batch = gpt()
    torch.compile(first)(batch(0)).float().sum().backward()   # dynamo caches the class's forward, and guards on no hook
    model, _ = gpt()
    compiled = torch.compile(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        te = torchEmber(compiled, run='second', db=str(tmp_path / 'second.db'))
    assert any('compiled modules before' in str(x.message) for x in w)   # the first instance's code: discarded, said
    for s in range(2): compiled(batch(s)).float().sum().backward()
    te.flush()
    df = te.df()
    names = {n for n, _ in model.named_modules() if n != 'blocks' and not n.endswith('out_proj')}   # never called, eager too
    for step in (0, 1):
        assert set(df[(df.step == step) & (df.ttype == 'output')].module) == names, step
    te.disarm()

def test_first_traced_on_an_unrecorded_step(tmp_path):
    "Blocks compiled after a recorded eager step and first traced on an unrecorded one record at the next recorded step."
    model, batch = gpt()
    te = torchEmber(model, run='late', db=str(tmp_path / 'late.db'), every=2)
    model(batch(0)).float().sum().backward()       # step 0, eager, recorded
    blocks(model)
    for s in (1, 2): model(batch(s)).float().sum().backward()   # step 1 traces the blocks (unrecorded); step 2 recorded
    te.flush()
    df = te.df()
    assert set(df[df.step == 2].module) == set(df[df.step == 0].module)
    assert (df[df.module.str.startswith('blocks.')].groupby('step').size() > 0).all()
    te.disarm()

def test_custom_stats_and_histograms(tmp_path):
    "`how_record_*` and `hist=` under compile: run where the op runs, so a function dynamo could not trace records too."
    def peak(t):
        "A stat function dynamo would not trace (a host read, `.item()`, and numpy)."
        return {'peak': float(np.abs(t.detach().cpu().numpy()).max()), 'mean': t.float().mean().item()}
    out = {}
    for how in (eager, whole):
        torch._dynamo.reset(); counters.clear()
        model, batch = mlp()
        te = torchEmber(model, run='custom', db=str(tmp_path / f'{how.__name__}.db'), hist=4)
        te.how_record_out(peak)
        call = how(model)
        for s in range(2): call(batch(s)).square().mean().backward()
        te.flush()
        out[how.__name__] = te.df().sort_values(KEYS).reset_index(drop=True), sum(counters['graph_break'].values())
        te.disarm()
    (c, breaks), (e, _) = out['whole'], out['eager']
    assert breaks == 0
    assert c[KEYS].equals(e[KEYS])
    assert c['peak'].notna().eq(c.ttype == 'output').all() and c['hist'].notna().eq(c.ttype != 'output').all()
    for col in ['peak', 'mean', 'std', 'norm', 'hist_lo', 'hist_hi', 'hist_out']:
        np.testing.assert_allclose(c[col].to_numpy(float), e[col].to_numpy(float), rtol=1e-5, atol=1e-6, err_msg=col)
    for a, b in zip(c['hist'], e['hist']):
        if isinstance(b, list): np.testing.assert_allclose(a, b)   # counts: a value on a bin's edge may move with rounding

def test_bare_instance_compiled_beside(tmp_path):
    "A bare instance of the armed model's class, compiled after it, runs its own code, and the armed one goes on recording."
    torch._dynamo.reset()
    armed, batch = mlp()
    te = torchEmber(armed, run='beside', db=str(tmp_path / 'beside.db'))
    run_armed = torch.compile(armed)
    run_armed(batch(0)).sum().backward()
    bare, _ = mlp()
    run_bare = torch.compile(bare)
    for s in range(2):
        run_bare(batch(s)).sum().backward()
        run_armed(batch(s)).sum().backward()
    te.flush()
    df = te.df()
    assert sorted(set(df.step)) == [0, 1, 2]
    assert (df[df.ttype == 'output'].groupby('step').size() == len(list(armed.modules()))).all()
    te.disarm()

def test_one_op_a_region(tmp_path, monkeypatch):
    "Python runs once a traced call of a compiled module's child (its `record_calls` op), not once a module call."
    from torchember.compiled import CompiledHooks
    calls = {'region': 0, 'hook': 0}
    take_calls, take = CompiledHooks.take_calls, CompiledHooks.take
    def counted(name, fn):
        def f(self, *a):
            calls[name] += 1
            return fn(self, *a)
        return f
    monkeypatch.setattr(CompiledHooks, 'take_calls', counted('region', take_calls))
    monkeypatch.setattr(CompiledHooks, 'take', counted('hook', take))
    # whole: one a child of the root (13 for gpt9's 67 module calls a step); by block: one a child of a block (4 of 7)
    for make, how, most in ((gpt9, whole, 13), (gpt9, blocks, 9 * 4), (mlp, whole, 8)):
        calls.update(region=0, hook=0)
        out = train(make, how, tmp_path, steps=4, every=2)
        assert calls['hook'] == 0 and 4 <= calls['region'] <= 4 * most, (make.__name__, how.__name__, calls)
        assert set(out['df'].step) == {0, 2} and (out['df'].ttype == 'output').any()


class Shared(nn.Module):
    "One block applied three times a step (ALBERT's sharing), between two layers of its own."
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 2)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    def forward(self, x):
        x = self.inp(x)
        for _ in range(3): x = x + self.block(x)
        return self.out(x)

def shared():
    torch.manual_seed(0)
    return Shared(), lambda s: torch.randn(4, 8, generator=torch.Generator().manual_seed(s))

def shared_block(m): m.block.compile(fullgraph=True); return m

def test_a_block_called_again(tmp_path):
    "A compiled block called three times a step: calls 0, 1 and 2 of each of its modules, and events, as eager."
    c = train(shared, shared_block, tmp_path, steps=3, every=1)
    e = train(shared, eager, tmp_path, steps=3, every=1)
    assert c['breaks'] == 0 and c['events'] == e['events']
    cols = KEYS + ['shape', 'dtype']
    assert c['df'][cols].equals(e['df'][cols]) and set(c['df'].call) == {0, 1, 2}
    for col in ['mean', 'std', 'norm']:
        np.testing.assert_allclose(c['df'][col].to_numpy(float), e['df'][col].to_numpy(float), rtol=1e-5, atol=1e-6)


def test_batch_size_changes(tmp_path):
    "Batches of 8, 5, 8 and 3 rows through a model compiled whole (a recompile, then dynamic shapes): eager's rows."
    sizes = [8, 5, 8, 3]
    def run(how):
        torch._dynamo.reset()
        torch.manual_seed(0)
        layers = []
        for _ in range(3): layers += [nn.Linear(16, 16), nn.GELU()]
        model = nn.Sequential(*layers)
        te = torchEmber(model, run='r', db=str(tmp_path / f'sizes-{how.__name__}.db'))
        call, opt = how(model), torch.optim.SGD(model.parameters(), lr=0.05)
        for s, n in enumerate(sizes):
            call(torch.randn(n, 16, generator=torch.Generator().manual_seed(s))).square().mean().backward()
            opt.step(); opt.zero_grad()
        te.flush()
        df = te.df().sort_values(KEYS).reset_index(drop=True)
        te.disarm()
        return df
    c, e = run(whole), run(eager)
    assert c[KEYS + ['shape', 'dtype']].equals(e[KEYS + ['shape', 'dtype']])
    assert {tuple(s)[0] for s in c[c.ttype == 'output']['shape']} == set(sizes)
    for col in ['mean', 'std', 'norm', 'min', 'max']:
        np.testing.assert_allclose(c[col].to_numpy(float), e[col].to_numpy(float), rtol=1e-5, atol=1e-6, err_msg=col)


class Net(nn.Module):   # a class of the user's: `torch.compile(model)` compiles its forward, the root's hooks run outside
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 1)
    def forward(self, x): return self.fc2(torch.tanh(self.fc1(x)))

def test_root_hooks_outside_the_graph_are_no_frames(tmp_path):
    "Compiled whole, the hooks that run around the graph (the data flow's, `stop_on`'s) run as Python, never as frames."
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torchember.graph import GraphCapture
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    te = torchEmber(model, run='r', db=str(tmp_path / 'r.db'), stop_on=['nonfinite'])
    call, opt = torch.compile(model), torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        call(torch.randn(8, 4)).square().mean().backward()
        opt.step(); opt.zero_grad()
    # a frame of its own costs a cache lookup a step; compiled, `is_compiling()` made each a no-op, and stop_on never fired
    for fn in (GraphCapture._root_pre, GraphCapture._root_post, type(te)._check_stop):
        assert not _debug_get_cache_entry_list(fn.__code__), fn.__qualname__
    assert te._flows.off and not te._flows._root   # a compiled model's data flow is not followed: its hooks are gone
    te.disarm()

def sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

def net():
    torch.manual_seed(0)
    return Net()

@pytest.mark.parametrize('make, how', [(net, whole), (sequential, whole), (sequential, method)],
                         ids=['class-whole', 'sequential-whole', 'sequential-method'])
def test_stop_on_fires_compiled(tmp_path, make, how):
    "`stop_on=['nonfinite']` stops a compiled model at a forward soon after the writer judged a NaN step; no recompile."
    # compiled whole through its `forward`, the root's hooks run around the graph; an `nn.Sequential` or
    # `model.compile()` traces them, and the `step` op raises where the step opens
    from torchember.ember import TrainingStopped
    torch._dynamo.reset(); counters.clear()
    model = make()
    te = torchEmber(model, run='nan', db=str(tmp_path / 'nan.db'), stop_on=['nonfinite'])
    call, opt = how(model), torch.optim.SGD(model.parameters(), lr=0.01)
    g, ran = torch.Generator().manual_seed(1), 0
    with pytest.raises(TrainingStopped):
        for i in range(3000):
            x = torch.randn(8, 4, generator=g)
            if i == 5: x[0, 0] = float('nan')
            call(x).square().mean().backward()
            opt.step(); opt.zero_grad()
            ran = i
            time.sleep(0.002)
    assert 5 <= ran < 2900
    assert counters['stats']['unique_graphs'] == 1   # the finding changed no guarded value
    te.disarm()


def test_many_armed_models_of_a_class_alive_at_once_compile_with_fullgraph(tmp_path):
    "Twelve armed models of one class, compiled with `fullgraph=True`, alive at once: none raises (the ninth did)."
    # each compiles a graph of its own (bare ones share one); dynamo's recompile_limit of 8 made the ninth raise
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    try:
        made = []
        for i in range(12):
            torch.manual_seed(i)
            m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            made.append((torch.compile(m, fullgraph=True), torchEmber(m, run=f'm{i}', db=tmp_path/'s.db')))
        x = torch.randn(4, 8)
        for _ in range(2):
            for call, _ in made: call(x).sum().backward()
        for _, te in made: assert te.flush().run.n_steps == 2
        for _, te in made: te.disarm()
    finally: torch._dynamo.config.recompile_limit = limit
