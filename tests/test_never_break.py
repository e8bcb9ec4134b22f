"""Reliability (issue 5), part 1: arming never breaks training.

An armed model computes exactly what the bare one does, whatever flows through it (odd tensors, odd arguments,
recursion, exceptions, modules made on the fly, in-place ops); a broken stat function costs one warning, not the
run; and arming/disarming in any order leaves the model exactly as it was.
"""
import copy, dataclasses, gc, json, math, os, subprocess, sys, textwrap, uuid, warnings, weakref
from collections import OrderedDict

import pytest, torch
from torch import nn
from hypothesis import HealthCheck, given, settings, strategies as st

from torchember import torchEmber, load, default_stats
from torchember.core import Capture


# ---------------------------------------------------------------- helpers

HOOK_DICTS = ('_forward_hooks', '_forward_pre_hooks', '_forward_hooks_with_kwargs', '_forward_hooks_always_called',
              '_forward_pre_hooks_with_kwargs', '_backward_hooks', '_backward_pre_hooks')

def snapshot(model):
    "Every module's `vars`, with dict values copied (so a hook added to a dict shows as a difference)."
    return {n: {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(m).items()} for n, m in model.named_modules()}

def hook_counts(model):
    return {n: tuple(len(getattr(m, a)) for a in HOOK_DICTS) for n, m in model.named_modules()}, \
           [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]

TORCH_MARKS = ('_is_torch_compile', '_compile_kwargs')   # what torch.compile (and Lightning's wrapper of it, once imported) writes into a module's __dict__

def assert_bare(model, before, ignore=()):
    "No hook of any kind on any module or parameter, and every module's attributes as in `before` (but `ignore`d keys)."
    for n, m in model.named_modules():
        for a in HOOK_DICTS: assert not getattr(m, a), f"module {n!r} still has {a}: {dict(getattr(m, a))}"
        assert 'disarm' not in vars(m), f"module {n!r} still has a `disarm` attribute"
    for n, p in model.named_parameters():
        assert not p._post_accumulate_grad_hooks, f"parameter {n!r} still has post-accumulate-grad hooks"
        assert not p._backward_hooks, f"parameter {n!r} still has backward hooks"
    strip = lambda snap: {n: {k: v for k, v in d.items() if k not in ignore} for n, d in snap.items()}
    assert strip(snapshot(model)) == strip(before)
    from torch.nn.modules import module as M
    assert not (M._global_forward_hooks or M._global_forward_pre_hooks or M._global_backward_hooks
                or M._global_backward_pre_hooks), "global module hooks were left behind"

def run_name(): return f"r-{uuid.uuid4().hex[:10]}"

def tw(rec):
    "The torchember warnings among `rec` (a `catch_warnings(record=True)` list)."
    return [str(w.message) for w in rec if str(w.message).startswith('torchember')]

@pytest.fixture(scope='module')
def store(tmp_path_factory):
    "One store for the tests of this module that run many small runs (each run has a unique name)."
    return str(tmp_path_factory.mktemp('never_break')/'store.db')


# ---------------------------------------------------------------- odd tensors (property test)

class Echo(nn.Module):
    "Returns whatever it is given, untouched."
    def forward(self, *args, **kwargs): return args, kwargs

class Wrap(nn.Module):
    "Passes the call through `echo`; also trains `lin` (through a `frozen` layer) and never uses `unused`."
    def __init__(self):
        super().__init__()
        self.echo, self.lin, self.frozen, self.unused = Echo(), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.register_buffer('base', torch.linspace(-1, 1, 4).reshape(2, 2))
    def forward(self, *args, **kwargs):
        return self.echo(*args, **kwargs), self.lin(self.frozen(self.base))

FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COMPLEX = (torch.complex64, torch.complex128)
DTYPES = FLOAT + COMPLEX + (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)
LAYOUTS = ('contiguous', 'transposed', 'strided_slice', 'view_of_view', 'expanded', 'sparse_coo', 'meta')

def _values(shape, dtype, g):
    if dtype in FLOAT or dtype in COMPLEX: return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) if dtype in FLOAT \
        else torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool: return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)

SPECIAL = {'nan': float('nan'), 'inf': float('inf'), '-inf': float('-inf'), 'zero': 0.0, 'huge': 6e4}

@st.composite
def odd_tensors(draw):
    "Tensors of every dtype, 0-d to 3-d (empty included), contiguous or not, views of views, expanded, sparse COO, meta."
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    if layout in ('transposed', 'sparse_coo') and len(shape) < 2: shape = shape + (3,) * (2 - len(shape))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    special = draw(st.sampled_from([None, 'nan', 'inf', '-inf', 'zero', 'huge'])) if dtype in FLOAT + COMPLEX else None
    def base(s):
        v = _values(s, dtype, g)
        if special and v.numel(): v.view(-1)[0] = SPECIAL[special]
        return v
    if layout == 'meta': t = torch.empty(shape, dtype=dtype, device='meta')
    elif layout == 'transposed': t = base(shape[::-1]).transpose(0, -1)
    elif layout == 'strided_slice': t = base(shape[:-1] + (2 * shape[-1] + 1,))[..., ::2] if shape else base(())
    elif layout == 'view_of_view': t = base((2 * math.prod(shape) + 2,))[1:-1:2].view(shape).unsqueeze(0).squeeze(0)
    elif layout == 'expanded': t = base((1,) + shape[1:]).expand(shape) if shape else base(())
    elif layout == 'sparse_coo': t = base(shape).to_sparse()
    else: t = base(shape)
    if dtype in FLOAT + COMPLEX and draw(st.booleans()): t.requires_grad_()
    return t

def _expected(t):
    "numel, nan count, inf count and (if all finite) mean, min, max of `t` as torchember measures it (complex by magnitude)."
    x = t.detach()
    x = (x.abs() if x.is_complex() else x).to(torch.float64).reshape(-1)
    n, nan, inf = x.numel(), int(x.isnan().sum()), int(x.isinf().sum())
    finite = n > 0 and nan == 0 and inf == 0
    return n, nan, inf, ((x.mean().item(), x.min().item(), x.max().item()) if finite else None)

def _dense_copy(t):
    return None if t.device.type == 'meta' else (t.detach().to_dense() if t.is_sparse else t.detach()).clone()

def _assert_same(a, b):
    if a is None or b is None: assert a is None and b is None
    else: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

def _loss(out, args):
    loss = out[1].sum()
    for a in args:
        if a.requires_grad and a.layout == torch.strided and a.device.type != 'meta':
            loss = loss + (a.real if a.is_complex() else a).float().sum()
    return loss

@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=odd_tensors(), as_kwarg=st.booleans())
def test_odd_tensor_passes_through_unchanged_and_is_recorded(store, t, as_kwarg):
    torch.manual_seed(0)
    model = Wrap()
    bare, before = copy.deepcopy(model), snapshot(model)
    args, kwargs = ((), {'kw': t}) if as_kwarg else ((t,), {})
    tname = 'kw' if as_kwarg else 'args.0'
    version, snap, req = t._version, _dense_copy(t), t.requires_grad

    out_b = bare(*args, **kwargs)
    _loss(out_b, [t]).backward()
    grad_b = None if t.grad is None else t.grad.clone()
    t.grad = None

    te = torchEmber(model, run=run_name(), db=store)
    for _ in range(2):   # a second step works just as the first
        out = model(*args, **kwargs)
        echoed = out[0][1]['kw'] if as_kwarg else out[0][0][0]
        assert echoed is t
        assert torch.equal(out[1], out_b[1])
        _loss(out, [t]).backward()
    # the tensor itself: same object, same values, same version counter, same autograd state
    assert t._version == version and t.requires_grad == req
    _assert_same(_dense_copy(t), snap)
    if grad_b is not None: assert torch.equal(t.grad, 2 * grad_b)
    for (n, p1), (_, p2) in zip(bare.named_parameters(), model.named_parameters(), strict=True):
        assert (p1.grad is None) == (p2.grad is None), n
        if p1.grad is not None: assert torch.equal(2 * p1.grad, p2.grad), n

    df = te.latest()
    assert df.step.unique().tolist() == [1]
    rows = df[(df.module == 'echo') & (df.ttype == 'input') & (df.tname == tname)]
    assert len(rows) == 1, df[['module', 'ttype', 'tname']]
    row = rows.iloc[0]
    assert row['shape'] == tuple(t.shape) and row['dtype'] == str(t.dtype).removeprefix('torch.')
    if t.layout == torch.strided and t.device.type != 'meta':
        n, nan, inf, fin = _expected(t)
        assert row['numel'] == n and row['nan_count'] == nan and row['inf_count'] == inf
        if fin is not None:
            mean, mn, mx = fin
            assert row['min'] == pytest.approx(mn, rel=1e-12, abs=1e-12) and row['max'] == pytest.approx(mx, rel=1e-12, abs=1e-12)
            assert row['mean'] == pytest.approx(mean, rel=1e-6, abs=1e-9)
    # weight grads: exactly the parameters that got one (not the frozen layer, not the unused one)
    g = df[df.ttype == 'weight_grad']
    assert sorted(g.module + '.' + g.tname) == ['lin.bias', 'lin.weight']
    te.disarm()
    assert_bare(model, before)


def test_meta_tensor_numel_is_recorded(db):
    model = Echo()
    te = torchEmber(model, run='meta', db=db)
    model(torch.empty(3, 4, device='meta'))
    row = te.latest().query("ttype == 'input'").iloc[0]
    assert default_stats(torch.empty(3, 4, device='meta')) == {'numel': 12}
    assert row['numel'] == 12


# tensors the property test above leaves out: nested (strided and jagged), sparse CSR, quantized
def _nested(): return torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
def _jagged(): return torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
def _csr(): return torch.eye(3).to_sparse_csr()
def _quant():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)

EXOTIC = [_csr, _nested, _jagged, _quant]
EXOTIC_IDS = ['sparse_csr', 'nested_strided', 'nested_jagged', 'quantized']
@pytest.mark.parametrize('make', EXOTIC, ids=EXOTIC_IDS)
def test_exotic_tensor_layouts_do_not_break_the_forward(db, make):
    t = make()
    model = Echo()
    te = torchEmber(model, run='exotic', db=db)
    for _ in range(2):
        out = model(t)
        assert out[0][0] is t
    te.flush()
    te.disarm()
    assert te.run.n_steps == 2

@pytest.mark.parametrize('make', [pytest.param(m, id=i) for m, i in zip(EXOTIC, EXOTIC_IDS)])
def test_exotic_tensor_layouts_read_back(db, make):
    t = make()
    model = Echo()
    te = torchEmber(model, run='exotic', db=db)
    model(t)
    te.disarm()
    rows = load('exotic', db).df().query("ttype == 'input'")
    assert rows.tname.tolist() == ['args.0'] and rows.dtype.tolist() == [str(t.dtype).removeprefix('torch.')]


def _padded_encoder():
    "A 2-layer `nn.TransformerEncoder` in eval mode, a batch, and a padding mask (one sequence padded)."
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    x, mask = torch.randn(3, 5, 8), torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True
    return enc, x, mask

def test_transformer_encoder_eval_fast_path_is_not_broken(db):
    "nn.TransformerEncoder's fast path (eval, no_grad, a padding mask: the defaults) hands nested tensors to its layers."
    enc, x, mask = _padded_encoder()
    with torch.no_grad(): expected = enc(x, src_key_padding_mask=mask)
    te = torchEmber(enc, run='tf-eval', db=db)
    with torch.no_grad(): out = enc(x, src_key_padding_mask=mask)
    assert torch.equal(out, expected)
    te.disarm()

def test_transformer_encoder_eval_run_reads_back(db):
    "A validation pass of an armed transformer in eval mode must not make its run unreadable."
    enc, x, mask = _padded_encoder()
    te = torchEmber(enc, run='tf-eval', db=db)
    with torch.no_grad(): enc(x, src_key_padding_mask=mask)
    te.disarm()
    df = load('tf-eval', db).df()
    assert {'', 'layers.0', 'layers.1'} <= set(df.module)


# ---------------------------------------------------------------- odd calls

@dataclasses.dataclass
class Cfg:
    scale: float
    shift: torch.Tensor
    label: str = 'cfg'

class OddCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.echo = nn.Linear(3, 3), Echo()
    def forward(self, x, none, text, n, cfg, nested, **extra):
        self.echo(none, text, n, cfg, nested, **extra)
        return self.lin(x) * cfg.scale + cfg.shift, none, text, n, cfg, nested

def _deep(leaf, depth=50):
    "`depth` levels of alternating dicts and lists around `leaf`, with a tensor at every level."
    obj = leaf
    for i in range(depth):
        obj = {'k': obj, 't': torch.full((2,), float(i))} if i % 2 else [obj, torch.full((1,), float(i))]
    return obj

def test_odd_arguments_pass_through(db):
    torch.manual_seed(0)
    model = OddCalls()
    bare, before = copy.deepcopy(model), snapshot(model)
    x = torch.randn(4, 3)
    cfg = Cfg(0.5, torch.ones(3))
    leaf = torch.arange(5.)
    nested = _deep(leaf)
    cyclic = {'t': torch.ones(2)}
    cyclic['self'] = cyclic
    call = lambda m: m(x, None, 'some text', 7, cfg, nested, cyclic=cyclic, flag=True, f=1.5, b=b'bytes')
    out_b = call(bare)
    te = torchEmber(model, run='odd-calls', db=db)
    out = call(model)
    assert torch.equal(out[0], out_b[0])
    assert out[1] is None and out[2] == 'some text' and out[3] == 7 and out[4] is cfg and out[5] is nested
    out[0].sum().backward(); out_b[0].sum().backward()
    for p1, p2 in zip(bare.parameters(), model.parameters()): assert torch.equal(p1.grad, p2.grad)
    df = te.latest()
    echo_in = set(df.query("module == 'echo' and ttype == 'input'").tname)
    # a dataclass field, three levels of the deep container, the self-referencing dict
    assert {'args.3.shift', 'args.4.t', 'args.4.k.1', 'args.4.k.0.t', 'cyclic.t'} <= echo_in
    root_in = set(df.query("module == '' and ttype == 'input'").tname)
    assert {'x', 'cfg.shift', 'nested.t', 'cyclic.t'} <= root_in
    te.disarm()
    assert_bare(model, before)


CYCLE = textwrap.dedent('''
    import sys, torch
    from torch import nn
    from torchember import torchEmber
    class Echo(nn.Module):
        def forward(self, x, ctx): return x
    model = Echo()
    ctx = {'t': torch.ones(2)}
    ctx['parent'] = ctx; ctx['root'] = ctx        # a context object that points at itself twice
    model(torch.ones(2), ctx)                     # bare: instant
    te = torchEmber(model, run='cycle', db=sys.argv[1])
    model(torch.ones(2), ctx)
    te.disarm()
    print('done', flush=True)
''')

def test_self_referencing_argument_does_not_hang(tmp_path):
    "Run in a process of its own, so a hang costs a timeout rather than the test session."
    # the process imports torch and torchember (3 s idle, 20-22 s beside 6 busy processes on 2 cores): a hang is
    # told by the timeout, never by how long it took
    (tmp_path/'cycle.py').write_text(CYCLE)
    try:
        r = subprocess.run([sys.executable, str(tmp_path/'cycle.py'), str(tmp_path/'cycle.db')], capture_output=True,
                           text=True, timeout=300, env={**os.environ, 'TORCHEMBER_COMPILE': '0'})
    except subprocess.TimeoutExpired:
        pytest.fail("an armed forward with a self-referencing argument did not return within 300 s")
    assert r.returncode == 0 and r.stdout.strip() == 'done', r.stderr[-3000:]


class Recursive(nn.Module):
    "Calls itself `depth` times, then its layer; `layer` runs once per level."
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 3)
    def forward(self, x, depth:int=3):
        if depth == 0: return self.layer(x)
        return self.layer(self(x, depth=depth - 1)).tanh()

class Host(nn.Module):
    def __init__(self):
        super().__init__()
        self.rec, self.shared = Recursive(), nn.Linear(3, 3)
    def forward(self, x): return self.shared(self.rec(self.shared(x)))

@pytest.mark.parametrize('root_recursive', [False, True])
def test_recursive_and_repeated_calls(db, root_recursive):
    torch.manual_seed(0)
    model = Recursive() if root_recursive else Host()
    bare, before = copy.deepcopy(model), snapshot(model)
    te = torchEmber(model, run='recursive', db=db)
    for step in range(2):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
        o1, o2 = bare(x), model(x)
        assert torch.equal(o1, o2)
        o1.sum().backward(); o2.sum().backward()
        for (n, p1), (_, p2) in zip(bare.named_parameters(), model.named_parameters()): assert torch.equal(p1.grad, p2.grad), n
    assert te.flush().run.n_steps == 2                              # one step per outermost call, recursion included
    df = te.latest()
    rec = '' if root_recursive else 'rec'
    layer = 'layer' if root_recursive else 'rec.layer'
    assert sorted(df.query(f"module == '{rec}' and ttype == 'output'")['call']) == [0, 1, 2, 3]
    assert sorted(df.query(f"module == '{layer}' and ttype == 'output'")['call']) == [0, 1, 2, 3]
    seq = te.sequence()
    if root_recursive: assert seq == _rec_seq(rec, layer)
    else: assert seq == ['enter ', 'enter shared', 'exit shared'] + _rec_seq(rec, layer) + ['enter shared', 'exit shared', 'exit ']
    if not root_recursive: assert sorted(df.query("module == 'shared' and ttype == 'input'")['call']) == [0, 1]
    # weights once per step, however often the module ran
    assert len(df.query("ttype == 'weight'")) == len(list(model.parameters()))
    te.disarm()
    assert_bare(model, before)

def _rec_seq(rec, layer, depth=3):
    "The enter/exit order of `Recursive` with `depth`: nested entries, the base layer, then one layer per level."
    out = [f'enter {rec}'] * (depth + 1) + [f'enter {layer}', f'exit {layer}', f'exit {rec}']
    for _ in range(depth): out += [f'enter {layer}', f'exit {layer}', f'exit {rec}']
    return out


# ---------------------------------------------------------------- exceptions

class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.err = nn.Linear(3, 3), None
    def forward(self, x):
        x = self.lin(x)
        if self.err is not None: raise self.err
        return x

class MyError(Exception):
    def __init__(self, msg, code): super().__init__(msg); self.code = code

class RootBoom(nn.Module):
    "first -> boom -> last; `err` makes the root itself raise after its children ran, `boom.err` makes the child raise."
    def __init__(self):
        super().__init__()
        self.first, self.boom, self.last, self.err = nn.Linear(3, 3), Boom(), nn.Linear(3, 1), None
    def forward(self, x):
        out = self.last(self.boom(self.first(x)))
        if self.err is not None: raise self.err
        return out

def _boom_model():
    torch.manual_seed(0)
    return RootBoom()

def _train(model, seed):
    model(torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))).sum().backward()

@pytest.mark.parametrize('where', ['child', 'root'])
def test_exception_in_forward_reaches_user_and_closes_step(db, where):
    model = _boom_model()
    before = snapshot(model)
    te = torchEmber(model, run='boom', db=db)
    _train(model, 0)
    whole, seq0, hooks = len(te.latest()), te.sequence(), hook_counts(model)
    err = MyError('forward failed: shape (2, 3) is wrong', code=42)
    if where == 'child': model.boom.err = err
    else: model.err = err
    with pytest.raises(MyError) as ei:
        _train(model, 1)
    assert ei.value is err and str(ei.value) == 'forward failed: shape (2, 3) is wrong' and ei.value.code == 42
    latest = te.latest()
    assert latest.step.unique().tolist() == [1]                           # the failed step is closed and stored
    assert hook_counts(model) == hooks                                    # no hook or handle leaked
    model.boom.err = model.err = None
    _train(model, 2)
    latest = te.latest()
    assert latest.step.unique().tolist() == [2] and len(latest) == whole and te.sequence() == seq0
    te.disarm()
    assert_bare(model, before)

def test_keyboard_interrupt_in_forward_does_not_wedge_step_counting(db):
    "torch runs always_call forward hooks only on `Exception`: a Ctrl-C in a forward skips the root's post hook."
    model = _boom_model()
    te = torchEmber(model, run='ctrl-c', db=db)
    _train(model, 0)
    whole = len(te.latest())
    model.boom.err = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        _train(model, 1)
    model.boom.err = None
    for seed in (2, 3, 4): _train(model, seed)
    latest = te.latest()
    assert latest.step.unique().tolist() == [4]
    assert len(latest) == whole
    te.disarm()


# ---------------------------------------------------------------- modules made on the fly, in-place ops

class OnTheFly(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
    def forward(self, x):
        x = self.inp(x)
        for layer in (nn.Linear(4, 4) for _ in range(3)): x = layer(x)    # made, called, never registered
        return nn.Sequential(nn.ReLU(), nn.Linear(4, 1))(x)

def test_modules_created_inside_forward(db):
    torch.manual_seed(0)
    model = OnTheFly()
    bare, before = copy.deepcopy(model), snapshot(model)
    te = torchEmber(model, run='fly', db=db)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(step); o1 = bare(x)
        torch.manual_seed(step); o2 = model(x)
        assert torch.equal(o1, o2)
        o1.sum().backward(); o2.sum().backward()
        assert torch.equal(bare.inp.weight.grad, model.inp.weight.grad)
    df = te.latest()
    assert set(df.module) == {'', 'inp'} and df.step.unique().tolist() == [1]
    # a module registered after arming is not known to the run, and must not break it either
    model.late = nn.Linear(4, 4)
    before[''] = {**before[''], '_modules': {**before['']['_modules'], 'late': model.late}}
    before['late'] = snapshot(model.late)['']
    model.late(model(torch.randn(3, 4))[:, :1].expand(3, 4)).sum().backward()
    assert te.flush().run.n_steps == 3
    te.disarm()
    assert_bare(model, before)


class Residual(nn.Module):
    "fc1 -> ReLU(inplace) -> fc2, `out += x`, the same ReLU again."
    def __init__(self, width):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width)
    def forward(self, x):
        h = self.relu(self.fc1(x))
        out = self.fc2(h)
        out += x
        return self.relu(out)

@pytest.mark.parametrize('rows', [4, 300], ids=['small', 'large'])   # 300x256 > SMALL: the fused one-pass path
def test_inplace_ops_are_measured_before_they_change(db, rows):
    torch.manual_seed(0)
    width = 256
    model = Residual(width)
    bare = copy.deepcopy(model)
    x = torch.randn(rows, width)
    with torch.no_grad():   # ground truth, value by value, from the bare model
        fc1 = bare.fc1(x); relu0 = fc1.clamp_min(0); fc2 = bare.fc2(relu0); res = fc2 + x; out = res.clamp_min(0)
    te = torchEmber(model, run='inplace', db=db)
    o = model(x)
    assert torch.equal(o, bare(x))
    o.sum().backward()
    df = te.latest().set_index(['module', 'call', 'ttype', 'tname'])
    expect = {('fc1', 0, 'output', 'output'): fc1, ('relu', 0, 'input', 'input'): fc1, ('relu', 0, 'output', 'output'): relu0,
              ('fc2', 0, 'output', 'output'): fc2, ('relu', 1, 'input', 'input'): res, ('relu', 1, 'output', 'output'): out,
              ('', 0, 'output', 'output'): out}
    for key, t in expect.items():
        r = df.loc[key]
        assert r['min'] == pytest.approx(t.min().item(), abs=1e-6), key
        assert r['max'] == pytest.approx(t.max().item(), abs=1e-6), key
        assert r['mean'] == pytest.approx(t.double().mean().item(), abs=1e-5), key
    assert df.loc[('fc1', 0, 'output', 'output')]['min'] < 0 <= df.loc[('relu', 0, 'output', 'output')]['min']
    te.disarm()


# ---------------------------------------------------------------- user stat functions that fail

class Shift(nn.Module):
    def forward(self, x): return x + 100
class Target(nn.Module):
    def forward(self, payload): return payload - 100

def _stat_model():
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(first=nn.Linear(4, 6), shift=Shift(), target=Target(), last=nn.Linear(6, 3)))

class StatBroke(Exception): pass

JUNK = {
    'raises': lambda t: (_ for _ in ()).throw(StatBroke('histogram overflow')),
    'not_a_dict': lambda t: [t.abs().max()],
    'none': lambda t: None,
    'str_value': lambda t: {'absmax': 'big'},
    'two_d_tensor': lambda t: {'absmax': t[:2, :2]},
    'int_key': lambda t: {0: 1.0},
    'object_value': lambda t: {'absmax': object()},
    'huge_int': lambda t: {'absmax': 10**400},
    'meta_tensor': lambda t: {'absmax': torch.empty((), device='meta')},
    'sparse_tensor': lambda t: {'absmax': torch.eye(2).to_sparse()[0]},
}

def _junk_fn(kind):
    base = JUNK[kind]
    def fn(t):
        if t.min() > 50: return base(t)        # only the input of `target` (values near 100)
        return {'absmax': t.abs().max()}
    fn.__name__ = f'stats_{kind}'
    return fn

@pytest.mark.parametrize('kind', JUNK)
def test_failing_stat_function_warns_once_and_training_goes_on(db, kind, monkeypatch):
    from torchember import stats
    # a loaded machine stalls a step 0.1 s inside the stat function now and then: its advice that the function is
    # slow (`stats.SLOW_S`) would be a second warning here, and says nothing of a failing one
    monkeypatch.setattr(stats, 'SLOW_S', float('inf'))
    model = _stat_model()
    bare = copy.deepcopy(model)
    te = torchEmber(model, run='junk', db=db)
    te.how_record_in(_junk_fn(kind))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            o1, o2 = bare(x), model(x)
            assert torch.equal(o1, o2)
            o1.sum().backward(); o2.sum().backward()
        df = te.df()
    msgs = tw(rec)
    assert len(msgs) == 1, msgs
    assert f"'stats_{kind}'" in msgs[0] and "'target'" in msgs[0] and "'payload'" in msgs[0] and 'input' in msgs[0]
    assert sorted(df.step.unique()) == [0, 1, 2]
    assert df.groupby('step').size().nunique() == 1                      # every step whole
    inputs = df[df.ttype == 'input']
    bad = inputs[inputs.module == 'target']
    assert len(bad) == 3 and bad['absmax'].isna().all()                  # the stat is skipped, the row stays
    assert inputs[inputs.module != 'target']['absmax'].notna().all()      # the others got theirs
    for p1, p2 in zip(bare.parameters(), model.parameters()): assert torch.equal(p1.grad, p2.grad)
    te.disarm()

@pytest.mark.parametrize('kind', ['raises', 'not_a_dict', 'str_value'])
def test_failing_stat_function_raises_with_strict(db, kind):
    model = _stat_model()
    te = torchEmber(model, run='strict', db=db, strict=True)
    fn = _junk_fn(kind)
    te.how_record_in(fn)
    with pytest.raises((StatBroke, TypeError)) as ei:
        model(torch.randn(5, 4))
    if kind == 'raises': assert str(ei.value) == 'histogram overflow'
    else: assert 'stats_' + kind in str(ei.value)
    te.how_record_in(default_stats)                                      # fixed: the next step is whole again
    model(torch.randn(5, 4)).sum().backward()
    good = te.latest()
    assert good.step.unique().tolist() == [1]
    assert len(good) == len(good.drop_duplicates(['module', 'call', 'ttype', 'tname']))
    assert set(good.ttype) == {'input', 'output', 'weight', 'weight_grad'}
    te.disarm()


# ---------------------------------------------------------------- torch.compile

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def _fresh_mlp():
    "`_mlp` as an instance of a class made for this call, so no code torch.compile cached for another test applies to it."
    class Fresh(nn.Sequential): pass
    torch.manual_seed(0)
    return Fresh(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def _losses(model, fwd, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        loss = fwd(torch.randn(16, 4, generator=g)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        out.append(loss.item())
    return out

def test_compiling_an_armed_model_trains(db):
    model, bare = _fresh_mlp(), _mlp()
    before = snapshot(model)
    te = torchEmber(model, run='armed-then-compiled', db=db)
    compiled = torch.compile(model)                      # the default backend; graph breaks are fine
    assert _losses(compiled, compiled) == pytest.approx(_losses(bare, bare), rel=1e-5, abs=1e-7)
    df = te.df()
    assert sorted(df.step.unique()) == [0, 1, 2, 3]
    assert df.groupby('step').size().nunique() == 1
    assert set(df.ttype) == {'input', 'output', 'weight', 'weight_grad'}
    te.disarm()
    n = te.run.n_steps
    compiled(torch.randn(2, 4)).sum().backward()         # disarmed: the compiled code records nothing more
    assert te.run.n_steps == n
    assert_bare(model, before, ignore=TORCH_MARKS)

def test_arming_a_compiled_model(db):
    "What torchember does today with an `OptimizedModule`: it arms the model inside, under the plain model's names."
    model, bare = _fresh_mlp(), _mlp()
    compiled = torch.compile(model, backend='eager')
    before_c, before_m = snapshot(compiled), snapshot(model)
    te = torchEmber(compiled, run='compiled-then-armed', db=db)
    assert _losses(model, compiled) == pytest.approx(_losses(bare, bare), rel=1e-5, abs=1e-7)
    df = te.df()
    assert sorted(df.step.unique()) == [0, 1, 2, 3]
    assert df.groupby('step').size().nunique() == 1
    assert set(df.module) == {n for n, _ in bare.named_modules()}
    assert len(df.query("ttype == 'weight_grad' and step == 3")) == 4
    compiled.disarm()                   # the model's own disarm, reached through the wrapper
    assert_bare(compiled, before_c, ignore=TORCH_MARKS)
    assert_bare(model, before_m, ignore=TORCH_MARKS)
    assert te.run.n_steps == 4

def test_a_capture_collected_as_dynamo_traces_changes_nothing_it_reads(db):
    "A capture freed by the garbage collector leaves `_BY_KEY` as it was: its key is dropped as a model is armed."
    # the collector may run inside dynamo's tracing of the module hooks, as it reads `_BY_KEY`: a weakref callback that
    # popped the key then raised "dictionary changed size during iteration" into a compiled forward (seen once in CI)
    from torchember import core
    model = _fresh_mlp()
    te = torchEmber(model, run='gone', db=db)
    torch.compile(model, backend='eager', fullgraph=True)(torch.randn(2, 4)).sum().backward()
    key = te.capture._by_key()
    te.disarm(); del te, model
    gc.collect()
    assert key in core._BY_KEY and core._BY_KEY[key]() is None, "a freed capture's key left while compiled code may run"
    other = _fresh_mlp()
    te = torchEmber(other, run='next', db=db)
    torch.compile(other, backend='eager', fullgraph=True)(torch.randn(2, 4)).sum().backward()
    assert key == te.capture._by_key() or key not in core._BY_KEY, "arming left a freed capture's key"
    stale = object.__new__(Capture)                       # an id now another's, its entry still the freed capture's
    core._BY_KEY[id(te.capture)] = weakref.ref(stale)
    assert core._BY_KEY[te.capture._by_key()]() is te.capture
    te.disarm()

@pytest.mark.parametrize('same_instance', [True, False], ids=['same_model', 'other_instance'])
@pytest.mark.filterwarnings('ignore:torchember. torch.compile had compiled')   # arming drops that code, with a warning
def test_arming_after_compiled_code_ran_still_records(db, same_instance):
    model = _fresh_mlp()
    warm = model if same_instance else type(model)(*[copy.deepcopy(m) for m in model])
    compiled_warm = torch.compile(warm, backend='eager')
    compiled_warm(torch.randn(2, 4)).sum().backward()   # compiled and run once, bare
    compiled = compiled_warm if same_instance else torch.compile(model, backend='eager')
    te = torchEmber(model, run='compiled-before-arming', db=db)
    for _ in range(3): compiled(torch.randn(2, 4)).sum().backward()
    assert te.flush().run.n_steps == 3
    te.disarm()


# ---------------------------------------------------------------- arming and disarming in any order

def test_arm_twice_disarm_twice(db):
    model = _mlp()
    before = snapshot(model)
    te = torchEmber(model, run='twice', db=db)
    model(torch.randn(2, 4)).sum().backward()
    hooks = hook_counts(model)
    te.arm(); te.rearm()
    assert hook_counts(model) == hooks
    model(torch.randn(2, 4)).sum().backward()
    assert te.flush().run.n_steps == 2
    te.disarm(); te.disarm()
    assert_bare(model, before)
    te.arm()                                                  # re-armed after a double disarm: same run, next step
    model(torch.randn(2, 4)).sum().backward()
    assert te.latest().step.unique().tolist() == [2]
    te.disarm()
    assert_bare(model, before)

def test_disarm_never_armed(db):
    model = _mlp()
    before = snapshot(model)
    Capture(model, recorder=None).disarm()                    # never armed: nothing to do, nothing breaks
    assert_bare(model, before)
    with pytest.raises(AttributeError): model.disarm()        # a bare model has no `disarm` of its own
    assert_bare(model, before)

def test_model_disarm_after_torchember_object_is_dropped(db):
    model = _mlp()
    before = snapshot(model)
    te = torchEmber(model, run='dropped', db=db)
    for _ in range(3): model(torch.randn(2, 4)).sum().backward()
    ref = weakref.ref(te)
    del te; gc.collect()
    model(torch.randn(2, 4)).sum().backward()                 # still recording
    model.disarm()
    assert_bare(model, before)
    gc.collect()
    assert ref() is None, "something still holds the torchEmber object after disarm"
    r = load('dropped', db)
    assert r.n_steps == 4 and r.last_step == 3                # disarm wrote everything, the last step included
    assert r.df().groupby('step').size().nunique() == 1

def test_arming_an_armed_model_then_model_disarm_is_clean(db):
    "Re-running a notebook cell `torchEmber(model)`, then `model.disarm()`: nothing of either arming is left."
    model = _mlp()
    before = snapshot(model)
    torchEmber(model, run='first', db=db)
    try: torchEmber(model, run='second', db=db)
    except (RuntimeError, ValueError) as e: assert 'armed' in str(e)     # refusing clearly is fine too
    model(torch.randn(2, 4)).sum().backward()
    model.disarm()
    assert_bare(model, before)

def test_context_manager_disarms_even_when_training_fails(db):
    model = _boom_model()
    model.boom.err = MyError('bad batch', code=1)
    before = snapshot(model)
    with pytest.raises(MyError):
        with torchEmber(model, run='ctx', db=db):
            _train(model, 0)
    assert_bare(model, before)
    assert load('ctx', db).n_steps == 1


def test_recorded_weights_are_the_current_parameters(db):
    model = _mlp()
    te = torchEmber(model, run='assign', db=db)
    model(torch.randn(2, 4)).sum().backward()
    model.load_state_dict({k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}, assign=True)
    model.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    df = te.latest()
    w = df.query("module == '0' and ttype == 'weight' and tname == 'weight'")
    assert w['mean'].item() == pytest.approx(0.25)
    assert len(df.query("ttype == 'weight_grad'")) == 4
    te.disarm()

def test_parameters_added_replaced_or_retyped_between_steps_are_seen(db):
    "Each recorded step reads the module's parameters as they are now, though it only checks that they are the same ones."
    model = _mlp()
    te = torchEmber(model, run='moved', db=db)
    names = lambda: set(te.latest().query("ttype == 'weight'").apply(lambda r: f"{r.module}.{r.tname}", axis=1))
    model(torch.randn(2, 4)).sum().backward()
    before = names()
    model[0].register_parameter('scale', nn.Parameter(torch.ones(1)))        # added
    model(torch.randn(2, 4)).sum().backward()
    assert names() == before | {'0.scale'}
    model[0].weight = nn.Parameter(torch.full_like(model[0].weight, 0.5))   # replaced
    model(torch.randn(2, 4)).sum().backward()
    assert te.latest().query("module == '0' and ttype == 'weight' and tname == 'weight'")['mean'].item() == pytest.approx(0.5)
    del model[0].scale                                                        # removed
    model(torch.randn(2, 4)).sum().backward()
    assert names() == before
    with pytest.warns(UserWarning, match='partitioned away'):                # emptied in place, as DeepSpeed's ZeRO-3 does
        for p in model[2].parameters(): p.data, p.ds_numel = torch.empty(0), p.numel()
        model[2].forward = lambda x: x[:, :1]                                  # `model[2]` sits this step out, as a partitioned layer would
        model(torch.randn(2, 4)).sum().backward()
    assert names() == {n for n in before if not n.startswith('2.')}
    te.disarm()

def test_lazy_modules_arm_and_are_recorded_once_they_have_shapes(db):
    "A `LazyLinear` has no shape until its first forward: arming it works, and its weights are recorded from the next step."
    torch.manual_seed(0)
    bare = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    armed = copy.deepcopy(bare)
    te = torchEmber(armed, run='lazy', db=db)
    for i in range(3):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(10 + i); a = armed(x)     # the first call draws the lazy layer's initial weights
        torch.manual_seed(10 + i); b = bare(x)
        a.sum().backward(); b.sum().backward()
        assert torch.equal(a, b)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(armed.parameters(), bare.parameters()))
    te.disarm()
    w = load('lazy', db).df(ttype='weight_grad')
    assert set(w.query("module == '0'")['step']) == {1, 2} and set(w.query("module == '2'")['step']) == {0, 1, 2}

@pytest.mark.parametrize('mode', ['trained', 'no-grad-forward', 'custom-grad-stats'])
def test_recorded_weights_are_those_the_forward_used(db, mode):
    "Weights are read with the grads (or when the step closes), yet must be the values before the optimizer changed them."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 4))   # one large weight (fused), the rest stacked
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    te = torchEmber(model, run='weights-used', db=db)
    if mode == 'custom-grad-stats': te.how_record_grad(lambda g: {'gmax': g.abs().max()})   # grads off the planned path
    used = []
    for _ in range(3):
        used.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if mode != 'no-grad-forward': model(torch.randn(8, 300)).pow(2).mean().backward()
        else:
            with torch.no_grad(): model(torch.randn(8, 300))   # no backward can follow: the weights are read as the forward ends
        with torch.no_grad():
            for p in model.parameters(): p.add_(p.grad if p.grad is not None else torch.ones_like(p), alpha=-0.5)
        opt.zero_grad()
    te.flush()
    df = te.df(ttype='weight')
    for step, params in enumerate(used[:2]):          # steps closed by the next forward, after the weights changed
        for name, p in params.items():
            module, _, tname = name.rpartition('.')
            r = df.query("step == @step and module == @module and tname == @tname")
            assert r['mean'].item() == pytest.approx(p.double().mean().item(), abs=1e-9), (step, name)
            assert r['max'].item() == pytest.approx(p.max().item()), (step, name)
    te.disarm()
