"""Real training scripts, armed (issue 25): they train exactly as bare, and their steps carry the iteration and kind
users count in.

The scripts are in `scripts.py`. A step is one call of the root module; `r.steps()` says for each its `iteration` (the
optimizer steps completed when it began: steps of any `torch.optim` optimizer holding the model's parameters, two
stepping together counted once; `te.iteration = n` sets it) and its `kind`: 'train', 'eval' (eval mode or
`inference_mode`) or 'no_grad' (train mode, no graph built: under `torch.no_grad()`, a sampling call).
"""
import multiprocessing

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from torchember import torchEmber, load, native
from scripts import SCRIPTS, nanogpt, dcgan, lstm_lm, lbfgs

INSTRUMENTS = dict(hist=16, sample_n=64, timing=True, io_grad=True, track_updates=True)

@pytest.fixture(autouse=True)
def _one_thread():
    "One torch thread: the scripts' ops are tiny, and two threads stall each other when another process holds a core."
    # on a busy 2-core machine this file took 112 s with two threads, 13 s with one; bare and armed use the same count
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

def _need_fork():
    if 'fork' not in multiprocessing.get_all_start_methods():
        pytest.skip("the GAN's DataLoader workers are forked, and this platform has no fork")

@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    "No kernel timings measured yet, in this process or its cache: the first large tensor recorded measures them."
    native.library()          # the kernel itself from the usual cache: building it again is not what is tested
    monkeypatch.setenv('TORCHEMBER_CACHE', str(tmp_path/'native-cache'))
    monkeypatch.setattr(native, '_large', {})

def _steps(out, which=None, contract=True):
    "The steps of `out`'s run (`which`: the GAN's 'D' or 'G') in order; `contract`: they must have iteration and kind."
    run = out['run'] if which is None else out['run'][which]
    s = load(run, out['db']).steps().sort_values('step').reset_index(drop=True)
    if contract: assert {'iteration', 'kind'} <= set(s.columns), f"steps() has no iteration or kind: {list(s.columns)}"
    return s


# ---------------------------------------------------------------- training is unchanged

CASES = dict(nanogpt=('nanogpt', {}), nanogpt_instruments=('nanogpt', INSTRUMENTS), dcgan=('dcgan', {}),
             lstm_lm=('lstm_lm', {}), lbfgs=('lbfgs', {}))

@pytest.mark.parametrize('name,ember', CASES.values(), ids=CASES.keys())
def test_armed_script_trains_as_bare(name, ember, tmp_path, fresh_native):
    "Losses, every state_dict tensor and torch's global RNG state at the end: bit for bit those of the bare run."
    if name == 'dcgan': _need_fork()
    fn = SCRIPTS[name]
    bare = fn(False, tmp_path/'bare'); rng_bare = torch.random.get_rng_state()
    armed = fn(True, tmp_path/'armed', **ember); rng_armed = torch.random.get_rng_state()
    assert len(_steps(armed, 'D' if name == 'dcgan' else None, contract=False)) > 0      # it was recorded at all
    wrong = []
    if not torch.equal(rng_bare, rng_armed): wrong.append("torch's global RNG was drawn from")
    if armed['losses'] != bare['losses']:
        i = next((i for i, (a, b) in enumerate(zip(armed['losses'], bare['losses'])) if a != b), None)
        wrong.append(f"{len(armed['losses'])} losses, not {len(bare['losses'])}" if i is None else
                     f"losses differ from loss {i}: {armed['losses'][i:i+3]} != {bare['losses'][i:i+3]}")
    assert armed['state'].keys() == bare['state'].keys()
    differ = [k for k in bare['state'] if not torch.equal(armed['state'][k], bare['state'][k])]
    if differ: wrong.append(f"{len(differ)} state_dict tensors differ, first {differ[:3]}")
    ga, gb = _flat_grads(armed.get('applied', [])), _flat_grads(bare.get('applied', []))
    if ga.keys() != gb.keys() or any(not torch.equal(ga[k], gb[k]) for k in gb):
        wrong.append("the grads the optimizer steps applied differ")
    assert not wrong, '; '.join(wrong)

def _flat_grads(applied, at=()) -> dict:
    "The grads of `applied` (a list of per-step `param_grads`, or a dict of such lists) keyed by where they are."
    if isinstance(applied, dict) and all(isinstance(v, list) for v in applied.values()):
        return {k: g for net, v in applied.items() for k, g in _flat_grads(v, at + (net,)).items()}
    return {at + (i,) + key: g for i, step in enumerate(applied) for key, g in step.items()}


def test_lstm_lm_saved_copy_is_bare(tmp_path):
    "torch.save of the armed LSTM LM pickles no torchember; the reloaded copy has no hooks and records nothing."
    out = lstm_lm(True, tmp_path)
    assert b'torchember' not in out['pickled']
    for n, m in out['reloaded'].named_modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks), n
        assert 'disarm' not in vars(m), n
    s = _steps(out, contract=False)
    assert s.step.tolist() == list(range(out['steps']))      # the training calls only: the copy's evaluation is none
    assert s.training.all()


# ---------------------------------------------------------------- iterations and kinds

def test_nanogpt_iterations_and_kinds(tmp_path):
    "4 micro-steps share an iteration; the loss estimates every 2 iterations are 'eval', at the iteration they follow."
    out = nanogpt(True, tmp_path, max_iters=4, eval_interval=2, grad_accum=4)
    s = _steps(out)
    assert s.step.tolist() == list(range(len(s)))                 # no step lost
    assert set(s.kind) == {'train', 'eval'}
    assert s.iteration.is_monotonic_increasing
    train, ev = s[s.kind == 'train'], s[s.kind == 'eval']
    assert train.training.all() and not ev.training.any()
    assert sorted(train.iteration.unique()) == list(range(out['opt_steps']))     # none in progress at the end
    for k, g in train.groupby('iteration'):
        first = g.step.iloc[0]
        assert g.step.tolist() == list(range(first, first + out['grad_accum'])), f"iteration {k}: {g.step.tolist()}"
    assert ev.iteration.tolist() == [it for it in out['evals'] for _ in range(out['eval_calls'])]
    assert s.kind.iloc[-1] == 'eval'                              # the loop ended with an estimate of the loss
    r, last_train = load(out['run'], out['db']), int(train.step.max())
    assert r.latest().step.unique().tolist() == [last_train]
    pd.testing.assert_frame_equal(r.summary(), r.summary(step=last_train))
    cols = list(r.diagnose().columns)
    assert 'iteration' in cols and abs(cols.index('iteration') - cols.index('step')) == 1, cols


def _assert_applied(out, s, applied, which=None, scaled=False):
    "For each iteration k, its last train step's weight grads are `applied[k]` (`scaled`: times one factor >= 1)."
    train = s[s.kind == 'train']
    g = load(out['run'] if which is None else out['run'][which], out['db']).df(ttype='weight_grad')
    for k, grads in enumerate(applied):
        last = train[train.iteration == k].step.max()
        rec = g[g.step == last].set_index(['module', 'tname'])['norm'].astype(float)
        assert set(rec.index) == set(grads), f"iteration {k}, step {last}: {sorted(rec.index)}"
        ratio = rec.to_numpy() / np.array([grads[key].norm().item() for key in rec.index])
        np.testing.assert_allclose(ratio, ratio[0] if scaled else 1.0, rtol=1e-5, err_msg=f"iteration {k}, step {last}")
        assert ratio[0] >= 1 - 1e-5

@pytest.mark.parametrize('clip', [None, 1.0], ids=['no-clip', 'clip'])
def test_grad_accumulation_last_micro_step_holds_applied_grads(tmp_path, clip):
    "An iteration's last micro-step holds the grads its optimizer step applied (clipped: before or after clipping)."
    out = nanogpt(True, tmp_path, max_iters=3, eval_interval=10, grad_accum=4, clip=clip)
    _assert_applied(out, _steps(out), out['applied'], scaled=clip is not None)


def test_dcgan_iterations_and_kinds(tmp_path):
    "D: 3 train steps a loop, iteration +1 at each optD.step(); G: iterations count optG steps, samples are 'no_grad'."
    _need_fork()
    out = dcgan(True, tmp_path)
    n = out['iters']
    D = _steps(out, 'D')
    assert len(D) == 3 * n and (D.kind == 'train').all()
    # D(real) and D(fake.detach()) before optD.step(), D(fake) for G's loss after it
    assert D.iteration.tolist() == [i + (j == 2) for i in range(n) for j in range(3)]
    assert D.iteration.nunique() == n + 1                         # the last D(fake) began an iteration optD never ended
    G = _steps(out, 'G')
    want = [[('train', i)] + ([('no_grad', i + 1)] if i in out['samples'] else []) for i in range(n)]
    assert list(zip(G.kind, G.iteration)) == sum(want, [])
    assert G.training.all()                                       # G samples in train mode: no_grad, not eval
    _assert_applied(out, D, out['applied']['D'], 'D')             # D(fake.detach())'s grads; D(fake)'s add G's loss
    _assert_applied(out, G, out['applied']['G'], 'G')


def test_lbfgs_closure_calls_share_an_iteration(tmp_path):
    "The closure calls of one LBFGS step are train steps of one iteration; the prediction under no_grad is 'no_grad'."
    out = lbfgs(True, tmp_path)
    calls = out['closure_calls']
    assert calls[0] > 1
    s = _steps(out)
    assert len(s) == sum(calls) + 1
    train = s.iloc[:-1]
    assert (train.kind == 'train').all()
    assert train.iteration.tolist() == [k for k, c in enumerate(calls) for _ in range(c)]
    last = s.iloc[-1]
    assert last.kind == 'no_grad' and last.training and last.iteration == out['opt_steps']


def test_iteration_set_by_hand(tmp_path):
    "`te.iteration = 100`: the next step is iteration 100, and the optimizer step after it makes 101."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def train_step():
        model(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
    with torchEmber(model, run='by-hand', db=str(tmp_path/'store.db'), overwrite=True) as te:
        train_step(); train_step()
        te.iteration = 100
        train_step(); train_step()
        now = te.iteration
    s = _steps(dict(run='by-hand', db=str(tmp_path/'store.db')))
    assert s.iteration.tolist() == [0, 1, 100, 101] and (s.kind == 'train').all()
    assert now == 102


def test_kind_of_a_call(tmp_path):
    "In train mode a call is 'train', 'no_grad' under no_grad, 'eval' under inference_mode; in eval mode, 'eval'."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    x = torch.randn(2, 4)
    with torchEmber(model, run='kinds', db=str(tmp_path/'store.db'), overwrite=True):
        model(x).sum().backward()
        with torch.no_grad(): model(x)
        with torch.inference_mode(): model(x)
        model.eval(); model(x)
        with torch.no_grad(): model(x)
    s = _steps(dict(run='kinds', db=str(tmp_path/'store.db')))
    assert s.kind.tolist() == ['train', 'no_grad', 'eval', 'eval', 'eval']
    assert s.training.tolist() == [True, True, False, False, False]
