"""Field-proof capture (issue 17, items 1, 4-8): arming holds in the setups people train in.

Inference mode (Lightning's validation), tensor hooks on long-lived leaves (parametrizations), backward times of
containers, activation checkpointing, copies of an armed model, and torch.compile.
"""
import copy, gc, io, math, os, pickle, subprocess, sys, textwrap, uuid, warnings

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


# ---------------------------------------------------------------- 4. tensor hooks never outlive their step

def _weight_normed():
    torch.manual_seed(0)
    return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.ReLU())

def _tensor_hooks(model):
    return {n: len(p._backward_hooks or {}) for n, p in model.named_parameters() if p._backward_hooks}

@pytest.mark.parametrize('opts', [dict(timing=True), dict(io_grad=True), dict(timing=True, io_grad=True, every=2)],
                         ids=['timing', 'io_grad', 'both_every2'])
def test_tensor_hooks_on_leaves_do_not_outlive_their_step(db, opts):
    model = _weight_normed()
    bare = copy.deepcopy(model)
    te = torchEmber(model, run=run_name(), db=db, **opts)
    for i in range(10):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        model(x).sum().backward(); bare(x).sum().backward()
        assert len(_tensor_hooks(model)) <= 2 and max(_tensor_hooks(model).values(), default=0) <= 1   # this step's only
    for a, b in zip(bare.parameters(), model.parameters()): assert torch.equal(a.grad, b.grad)
    df = te.df()
    te.disarm()
    assert _tensor_hooks(model) == {}
    if opts.get('io_grad'):
        g = df[df.ttype == 'input_grad'].groupby('step').size()
        assert g.nunique() == 1, g                           # no ghost rows piling up
    cap = te.capture
    import weakref
    ref = weakref.ref(cap)
    del te, cap; gc.collect()
    assert ref() is None                                   # nothing keeps the disarmed capture alive

class Scale(nn.Module):
    def forward(self, w): return w * 2

class Sometimes(nn.Module):
    "Uses its weight through `scale` only when asked; the weight gets a grad either way."
    def __init__(self):
        super().__init__()
        self.w, self.scale = nn.Parameter(torch.randn(4, 4)), Scale()
    def forward(self, x, use:bool): return x @ (self.scale(self.w) if use else self.w)

def test_no_ghost_grad_rows_for_calls_that_never_ran(db):
    torch.manual_seed(0)
    model = Sometimes()
    te = torchEmber(model, run=run_name(), db=db, io_grad=True, timing=True)
    model(torch.randn(2, 4), True).sum().backward()
    model(torch.randn(2, 4), False).sum().backward()
    model(torch.randn(2, 4), False).sum().backward()
    df = te.df()
    assert set(df[df.step == 0].module) == {'', 'scale'}
    assert set(df[df.step > 0].module) == {''}
    calls = te.run.calls()
    assert set(calls[calls.step > 0].module) == {''}
    te.disarm()
    assert not model.w._backward_hooks


# ---------------------------------------------------------------- 7. every call that took part in a backward has its time

class Backbone(nn.Module):
    "A root that owns no parameter, whose input needs no grad: its backward is that of what it holds."
    def __init__(self):
        super().__init__()
        self.prep = nn.Flatten()
        self.body = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
        self.head = nn.Sequential(nn.Identity(), nn.Linear(4, 1))
    def forward(self, x): return self.head(self.body(self.prep(x)))

@pytest.mark.parametrize('io_grad', [False, True])
def test_containers_get_their_backward_time(db, io_grad):
    torch.manual_seed(0)
    model = Backbone()
    te = torchEmber(model, run=run_name(), db=db, timing=True, io_grad=io_grad)
    for _ in range(2): model(torch.randn(3, 2, 2)).sum().backward()
    calls = te.flush().run.calls().set_index(['step', 'module'])
    te.disarm()
    assert calls.fwd_ms.notna().all()
    took_part = calls.drop(index='prep', level='module')            # every call whose output requires grad
    assert took_part.bwd_ms.notna().all(), took_part[took_part.bwd_ms.isna()]
    assert calls.xs('prep', level='module').bwd_ms.isna().all()      # no grad reached it: no backward
    assert (took_part.bwd_ms >= 0).all(), took_part.bwd_ms      # head.0, an Identity: its input grad is its output's
    for step in (0, 1):
        c = calls.loc[step].bwd_ms.drop('prep')
        for outer in ('', 'body', 'body.0', 'body.1', 'head'):        # a container's backward holds every call inside it,
            inner = c[[m for m in c.index if m.startswith(outer + '.' if outer else '') and m != outer]]
            assert c[outer] >= inner.max(), (outer, c)                # even one that shares its output (head.1, body.1.1)


class DroppedCall(nn.Module):
    "A layer called twice, the first call's output dropped: its weights get grads, that call gets none."
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 3)
    def forward(self, x):
        self.l(x)
        return self.l(x)

def test_a_call_no_grad_reached_has_no_backward_time(db):
    model = DroppedCall()
    te = torchEmber(model, run=run_name(), db=db, timing=True)
    model(torch.randn(2, 3)).sum().backward()
    calls = te.flush().run.calls().set_index(['module', 'call']).bwd_ms
    te.disarm()
    assert math.isnan(calls['l', 0]), calls                  # not 0, nor the time its module's weight grads took
    assert calls['l', 1] >= 0 and calls['', 0] >= calls['l', 1], calls


# ---------------------------------------------------------------- 6. activation checkpointing: recomputation is not a call

from torch.utils.checkpoint import checkpoint

class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)
    def forward(self, x): return x + self.fc2(self.act(self.fc1(x)))

class Net(nn.Module):
    def __init__(self, reentrant=None):
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.blocks, self.head = nn.Linear(4, 8), nn.ModuleList([Res(), Res()]), nn.Linear(8, 1)
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks: x = b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)

def _net(reentrant):
    torch.manual_seed(0)
    return Net(reentrant)

def _train(model, accumulate, steps=3):
    "Losses and grads of a few steps; with `accumulate`, two root calls make one optimizer step."
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        xs = [torch.randn(3, 4, generator=g) for _ in range(2 if accumulate else 1)]
        loss = sum(model(x).pow(2).mean() for x in xs)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step(); opt.zero_grad()
    return out

def _records(te):
    df = te.df().drop(columns=['run']).sort_values(['step', 'module', 'call', 'ttype', 'tname']).reset_index(drop=True)
    calls = te.run.calls()
    return df, [te.sequence(s) for s in sorted(df.step.unique())], calls[['step', 'module', 'call']].assign(timed=calls.bwd_ms.notna())

@pytest.mark.parametrize('accumulate', [False, True])
@pytest.mark.parametrize('reentrant', [True, False])
def test_checkpointed_recomputation_is_not_recorded(db, reentrant, accumulate):
    opts = dict(timing=True, io_grad=not reentrant)   # reentrant checkpointing runs the first forward without grad
    plain = _net(None)
    te0 = torchEmber(plain, run=run_name(), db=db, **opts)
    want = _train(plain, accumulate)
    want_df, want_seq, want_calls = _records(te0)
    te0.disarm()
    bare, model = _net(reentrant), _net(reentrant)
    te = torchEmber(model, run=run_name(), db=db, **opts)
    got, ref = _train(model, accumulate), _train(bare, accumulate)
    for (la, ga), (lb, gb) in zip(got, ref):                     # bit-identical to the bare checkpointed model
        assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    df, seq, calls = _records(te)
    te.disarm()
    assert seq == want_seq                                       # same calls, same order, no recomputed ones
    if reentrant: calls, want_calls = calls.drop(columns='timed'), want_calls.drop(columns='timed')
    assert calls.equals(want_calls)                              # without reentrance, the same calls have backward times
    assert df[['step', 'module', 'call', 'ttype', 'tname']].equals(want_df[['step', 'module', 'call', 'ttype', 'tname']])
    for (la, ga), (lb, gb) in zip(got, want):                    # and checkpointing changes nothing of the values
        assert torch.allclose(la, lb) and all(torch.allclose(a, b) for a, b in zip(ga, gb))


# ---------------------------------------------------------------- 5. a copy of an armed model is a clean bare model

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

def _user_hook(m, args:tuple[torch.Tensor], out:torch.Tensor)->torch.Tensor: return out * 1   # the user's: copies keep it

def _hooks(model):
    "Every module's hook dicts, as plain dicts of the hooks' identities (functions compare by identity)."
    names = ('_forward_hooks', '_forward_pre_hooks', '_forward_hooks_with_kwargs', '_forward_hooks_always_called',
             '_forward_pre_hooks_with_kwargs', '_backward_hooks', '_backward_pre_hooks')
    return {n: tuple(tuple(getattr(m, a).values()) for a in names) for n, m in model.named_modules()}

def _torchember_in(obj)->list:
    "Paths to anything of torchember's inside a module's state (attributes, hook dicts), found by walking it."
    found, seen = [], set()
    def walk(x, path):
        if id(x) in seen: return
        seen.add(id(x))
        if (type(x).__module__ or '').startswith('torchember') or 'torchember' in (getattr(getattr(x, '__func__', x), '__module__', '') or ''):
            found.append(path)
        if isinstance(x, nn.Module):
            for k, v in vars(x).items(): walk(v, f'{path}.{k}')
        elif isinstance(x, dict):
            for k, v in x.items(): walk(v, f'{path}[{k!r}]')
        elif isinstance(x, (list, tuple, set)):
            for i, v in enumerate(x): walk(v, f'{path}[{i}]')
    walk(obj, 'model')
    return found

COPIES = {'deepcopy': copy.deepcopy, 'pickle': lambda m: pickle.loads(pickle.dumps(m)),
          'torch.save': lambda m: (torch.save(m, buf := io.BytesIO()), buf.seek(0), torch.load(buf, weights_only=False))[2]}

@pytest.mark.parametrize('how', COPIES)
@pytest.mark.parametrize('opts', [{}, dict(timing=True, io_grad=True, every=2)], ids=['default', 'timed'])
def test_copy_of_an_armed_model_is_bare(db, how, opts):
    model, bare = _mlp(), _mlp()
    model[1].register_forward_hook(_user_hook); bare[1].register_forward_hook(_user_hook)
    te = torchEmber(model, run=run_name(), db=db, **opts)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    y = model(x)                                          # a step open, its hooks in place
    c = COPIES[how](model)
    assert _torchember_in(c) == []
    assert not hasattr(c, 'disarm')
    assert b'torchember' not in pickle.dumps(c)
    user = [type(h).__name__ for h in c[1]._forward_hooks.values()]
    assert user == ['function'] and all(not m._forward_pre_hooks for m in c.modules())
    assert all(not p._post_accumulate_grad_hooks for p in c.parameters())
    assert [vars(m).keys() for m in c.modules()] == [vars(m).keys() for m in bare.modules()]
    assert torch.equal(c(x), bare(x))
    torch.jit.script(c)                                    # the bare model scripts, and so does the copy
    n = te.flush().run.n_steps
    c(x).sum().backward()                                  # the copy records nothing
    assert te.flush().run.n_steps == n
    y.sum().backward()                                     # the armed model goes on recording
    model(x)
    assert te.flush().run.n_steps == n + 1
    te.disarm()
    assert _hooks(model) == _hooks(bare)

def test_copy_keeps_the_users_hooks_and_disarm_gives_copying_back(db):
    import copyreg
    class Only(nn.Sequential): pass                       # a class no other test arms
    torch.manual_seed(0)
    model = Only(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    h = model[0].register_forward_pre_hook(lambda m, a: None)
    te = torchEmber(model, run=run_name(), db=db)
    model(torch.randn(2, 4))
    c = copy.deepcopy(model)
    assert len(c[0]._forward_pre_hooks) == 1 and not c._forward_pre_hooks and not c._forward_hooks
    assert Only in copyreg.dispatch_table
    te.disarm()
    assert Only not in copyreg.dispatch_table              # copied as usual again
    h.remove()
    assert not model[0]._forward_pre_hooks

class _Sym(nn.Module):   # a parametrization: its module's class deep-copies itself its own way
    def forward(self, X): return X.triu() + X.triu(1).transpose(-1, -2)

@pytest.mark.parametrize('compiled', [False, True], ids=['eager', 'compiled'])
def test_copy_made_its_own_way_records_nothing_and_never_raises(db, compiled):
    "A parametrized module's copy keeps the module hooks: they record nothing, and raise nothing once the run is gone."
    from torch.nn.utils import parametrize
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    parametrize.register_parametrization(model[0], 'weight', _Sym())
    te = torchEmber(model, run=run_name(), db=db)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    y = model(x)                                          # a step open, its hooks in place
    c = copy.deepcopy(model)
    assert '__deepcopy__' in type(c[0]).__dict__          # copied its own way, hooks and all
    call = torch.compile(c) if compiled else c
    call(x).sum().backward()                              # while the original's step is open
    y.sum().backward()
    rows = te.flush().df()
    assert te.run.n_steps == 2 and len(rows.drop_duplicates(['step', 'module', 'ttype', 'tname'])) == len(rows)
    te.disarm(); del te, y; gc.collect()
    out = call(x)                                         # the capture is gone: the copy's hooks find none
    assert out.shape == (3, 2)

SAVE = """
import sys, torch
from torch import nn
from torchember import torchEmber
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
te = torchEmber(model, run='saved', db=sys.argv[1], timing=True, io_grad=True)
model(torch.randn(3, 4)).sum().backward()
model(torch.randn(3, 4))                        # saved with a step open
torch.save(model, sys.argv[2])
torch.save(model.state_dict(), sys.argv[3])
"""
LOAD = """
import sys
sys.modules['torchember'] = None               # torchember cannot be imported here
import torch
model = torch.load(sys.argv[1], weights_only=False)
model.load_state_dict(torch.load(sys.argv[2]))
assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
assert not [k for m in model.modules() for k in vars(m) if k in ('disarm', '__getstate__')]
torch.jit.script(model)
print(model(torch.ones(1, 4)).shape)
"""

def test_saved_armed_model_loads_without_torchember(tmp_path):
    env = dict(os.environ)
    paths = [str(tmp_path/n) for n in ('s.db', 'model.pt', 'sd.pt')]
    subprocess.run([sys.executable, '-c', SAVE, *paths], check=True, env=env, capture_output=True)
    out = subprocess.run([sys.executable, '-c', LOAD, *paths[1:]], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'torch.Size([1, 2])' in out.stdout


# ---------------------------------------------------------------- 8. torch.compile

def _fresh_mlp():
    "An MLP of a class made for this call, so no code torch.compile cached for another test applies to it."
    class Fresh(nn.Sequential): pass
    torch.manual_seed(0)
    return Fresh(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def _steps(fwd, model, n=6):
    for i in range(n): fwd(torch.randn(16, 4, generator=torch.Generator().manual_seed(i))).sum().backward()
    return [p.grad.clone() for p in model.parameters()]

@pytest.mark.parametrize('backend', ['eager', 'aot_eager'])
def test_dynamo_stays_out_of_torchembers_code(db, backend):
    import torch._dynamo as dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torchember.core import Capture
    from torchember.stats import Recorder
    dynamo.reset(); dynamo.utils.counters.clear()
    model, bare = _fresh_mlp(), _fresh_mlp()
    te = torchEmber(model, run=run_name(), db=db, timing=True, io_grad=True)
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        got = _steps(compiled, model)
    want = _steps(bare, bare)
    assert all(torch.allclose(a, b) for a, b in zip(got, want))
    c = dynamo.utils.counters
    assert not any('recompile' in k.lower() for k in c['unimplemented']), list(c['unimplemented'])
    assert c['stats']['unique_graphs'] <= 6                    # graph breaks at the hooks at most, no retracing per step
    for f in (Capture._root_pre, Capture._pre, Capture._post, Capture._on_grad, Recorder.tensor):
        assert not _debug_get_cache_entry_list(f.__code__), f   # dynamo compiled none of torchember's code
    assert not [m for m in tw(rec)]
    df = te.df()
    assert sorted(df.step.unique()) == list(range(6)) and df.groupby('step').size().nunique() == 1
    assert set(df.module) == {'', '0', '1', '2'} and {'input_grad', 'output_grad', 'weight_grad'} <= set(df.ttype)
    te.disarm()

@pytest.mark.parametrize('same_instance', [True, False], ids=['same_model', 'other_instance'])
def test_code_compiled_before_arming_is_dropped_with_a_warning(db, same_instance):
    model = _fresh_mlp()
    warm = model if same_instance else type(model)(*[copy.deepcopy(m) for m in model])
    torch.compile(warm, backend='eager')(torch.randn(2, 4)).sum().backward()   # compiled and run once, bare
    compiled = torch.compile(model, backend='eager')
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(model, run=run_name(), db=db)
    msgs = tw(rec)
    assert len(msgs) == 1 and 'torch.compile had compiled modules' in msgs[0]
    for _ in range(3): compiled(torch.randn(2, 4)).sum().backward()
    assert te.flush().run.n_steps == 3
    assert set(te.df().module) == {'', '0', '1', '2'}
    te.disarm()


def test_armed_model_in_a_lightning_fit_with_validation(db, tmp_path):
    "`Trainer.validate` (and `test`, `predict`) run under torch.inference_mode."
    L = pytest.importorskip('lightning.pytorch')
    class Reg(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 1))
        def forward(self, x): return self.net(x)
        def training_step(self, batch, i): return nn.functional.mse_loss(self(batch[0]), batch[1])
        def validation_step(self, batch, i): self.log('val', nn.functional.mse_loss(self(batch[0]), batch[1]))
        def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    dl = lambda: torch.utils.data.DataLoader(data, batch_size=8)
    torch.manual_seed(0)
    module = Reg()
    te = torchEmber(module, run=run_name(), db=db)
    trainer = L.Trainer(accelerator='cpu', max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, dl(), dl())
    trainer.validate(module, dl())                         # under torch.inference_mode
    steps = te.flush().run.steps()
    te.disarm()
    assert (~steps.training).sum() == 2 + 2 * 4 + 4      # the sanity check's 2 batches, 4 a validation epoch, validate's 4
    assert steps.training.sum() == 2 * 4
