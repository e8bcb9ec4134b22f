"Steps as the user counts them: iterations and kinds of steps, what reads them, and findings without false alarms (issue 25)."
import math
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torchember import torchEmber, load
from torchember.diagnose import band_edges, signals, GRAD_NORM, micro_steps, loss_followed
from torchember.query import applied_steps


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def accumulate(db, run='accum', iters=6, micro=3, eval_every=2, seed=0):
    "A loop with gradient accumulation, an eval call every `eval_every` iterations and a train-mode sampling call at the end."
    m = mlp(seed)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with torchEmber(m, run=run, db=db, overwrite=True) as te:
        for it in range(iters):
            for _ in range(micro):
                x = torch.randn(8, 4)
                ((m(x) - x.sum(1, keepdim=True)) ** 2).mean().div(micro).backward()
            opt.step(); opt.zero_grad()
            if (it + 1) % eval_every == 0:
                m.eval()
                with torch.no_grad(): m(torch.randn(16, 4))
                m.train()
        with torch.no_grad(): m(torch.randn(2, 4))      # a sampling call in train mode: no graph
    return load(run, db)


def test_steps_carry_iteration_and_kind(tmp_path):
    r = accumulate(str(tmp_path / 's.db'))
    st = r.steps()
    assert {'iteration', 'kind'} <= set(st.columns)
    train = st[st.kind == 'train']
    assert train.groupby('iteration').size().tolist() == [3] * 6          # three micro-steps an iteration
    ev = st[st.kind == 'eval']
    assert ev.iteration.tolist() == [2, 4, 6]                              # after the optimizer steps before them
    assert st.kind.iloc[-1] == 'no_grad' and st.iteration.iloc[-1] == 6
    assert st.iteration.is_monotonic_increasing


def test_applied_steps_are_each_iterations_last_micro_step(tmp_path):
    r = accumulate(str(tmp_path / 's.db'))
    k = r.step_kinds()
    applied = applied_steps(k)
    train = k[k.kind == 'train']
    assert applied == train.groupby('iteration').step.max().tolist()
    assert micro_steps(r, 0) == set(train.step) - set(applied)
    sig = signals(r, 0, r.last_step, 0)                                   # the global grad norm diagnose judges
    assert sorted(sig[GRAD_NORM].dropna().index) == applied


def test_no_optimizer_every_train_step_is_applied(tmp_path):
    m = mlp()
    with torchEmber(m, run='manual', db=str(tmp_path / 's.db')) as te:
        for _ in range(4):
            m(torch.randn(2, 4)).sum().backward()
            with torch.no_grad():
                for p in m.parameters(): p -= 0.01 * p.grad; p.grad = None
    k = load('manual', str(tmp_path / 's.db')).step_kinds()
    assert k.iteration.tolist() == [0] * 4 and applied_steps(k) == [0, 1, 2, 3]


def test_latest_and_summary_default_to_newest_train_step(tmp_path):
    r = accumulate(str(tmp_path / 's.db'))
    st = r.steps()
    newest_train = int(st[st.kind == 'train'].step.max())
    assert r.last_step > newest_train                                      # the run ended with eval and sampling calls
    lt = r.latest()
    assert lt.step.unique().tolist() == [newest_train] and lt.iteration.unique().tolist() == [5]
    assert 'weight_grad' in set(lt.ttype)
    s = r.summary()
    assert s.step.unique().tolist() == [newest_train] and s.iteration.unique().tolist() == [5]
    assert r.summary(step=r.last_step).step.unique().tolist() == [r.last_step]


class MaskedAttention(nn.Module):
    "Self-attention fed a causal mask of -inf, as Transformer LMs are."
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 8)
    def forward(self, x, mask): return self.out(self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = MaskedAttention()
    def forward(self, x):
        mask = torch.triu(torch.full((x.shape[1], x.shape[1]), -math.inf), 1)
        return self.block(x, mask)


def test_summary_counts_what_modules_make_not_a_causal_mask(tmp_path):
    torch.manual_seed(0)
    m = LM()
    with torchEmber(m, run='lm', db=str(tmp_path / 's.db')) as te:
        m(torch.randn(2, 5, 8)).sum().backward()
    s = load('lm', str(tmp_path / 's.db')).summary().set_index('module')
    assert s['nonfinite'].sum() == 0                                      # a healthy model made no NaN/Inf
    assert s.loc['block', 'nonfinite_inputs'] == 10                       # the mask's -inf, said apart
    assert load('lm', str(tmp_path / 's.db')).diagnose().query("kind == 'nonfinite'").empty


def test_bands_of_never_negative_series_stay_at_or_above_zero():
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_cauchy((200, 3))) + 0.01                       # heavy-tailed, like a grad norm
    lo, hi, med, mad = band_edges(x, 50, 10.0, 2.0, 10)
    assert np.nanmin(lo) >= 0
    y = x - 5                                                              # a series that goes below 0 keeps its band
    assert np.nanmin(band_edges(y, 50, 10.0, 2.0, 10)[0]) < 0


def spiky(db, run, loss_follows:bool, steps=80, at=60):
    "Training whose grads spike once at step `at`; the logged loss follows the spike or not."
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with torchEmber(m, run=run, db=db, overwrite=True) as te:
        for s in range(steps):
            x = torch.randn(16, 4, generator=g)
            loss = ((m(x) - x.sum(1, keepdim=True)) ** 2).mean()
            (loss * (300 if s == at else 1)).backward()                   # one batch whose grads are far larger
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step(); opt.zero_grad()
            te.log(loss=loss.item() * (50 if loss_follows and s >= at else 1))
    return load(run, db)


def test_a_grad_spike_the_loss_did_not_follow_is_info(tmp_path):
    db = str(tmp_path / 's.db')
    calm = spiky(db, 'calm', loss_follows=False)
    f = calm.diagnose()
    grad = f[(f.kind == 'spike') & (f.step == 60) & ((f.stat == GRAD_NORM) | (f.ttype == 'weight_grad'))]
    assert len(grad) and (grad.severity == 'info').all(), f[['kind', 'severity', 'step', 'stat', 'message']]
    assert grad.message.str.contains('held').all()
    bad = spiky(db, 'bad', loss_follows=True)
    f = bad.diagnose()
    grad = f[(f.kind == 'spike') & (f.stat == GRAD_NORM)]
    assert len(grad) and (grad.severity == 'warning').all(), f[['kind', 'severity', 'step', 'stat', 'message']]


def test_loss_followed_needs_logged_values_after_the_spike():
    idx = pd.Index(range(30), name='step')
    only_grads = pd.DataFrame({GRAD_NORM: np.ones(30)}, index=idx)
    assert loss_followed(only_grads, 20, 10, 10., 2., 5) is None          # nothing logged: can't tell
    logged = pd.DataFrame({GRAD_NORM: np.ones(30), 'loss': np.ones(30)}, index=idx)
    assert loss_followed(logged, 28, 10, 10., 2., 5) is None              # too near the end to tell
    assert loss_followed(logged, 20, 10, 10., 2., 5) is False


def test_ignore_quiets_findings_by_kind_and_glob(tmp_path):
    db = str(tmp_path / 's.db')
    r = spiky(db, 'bad', loss_follows=True)
    f = r.diagnose()
    assert (f.kind == 'spike').any()
    assert not (r.diagnose(ignore='spike').kind == 'spike').any()
    left = r.diagnose(ignore=[f'spike:{GRAD_NORM}'])
    assert not ((left.kind == 'spike') & (left.stat == GRAD_NORM)).any()
    with pytest.raises(ValueError, match="ignore="): r.diagnose(ignore=['spikes'])


def test_findings_and_diff_name_the_iteration(tmp_path):
    db = str(tmp_path / 's.db')
    a = accumulate(db, 'a')
    f = a.diagnose()
    assert list(f.columns)[:4] == ['kind', 'severity', 'step', 'iteration']
    accumulate(db, 'b', seed=1)
    from torchember import diff
    d = diff('a', 'b', db, max_steps=None)
    assert list(d.columns)[:2] == ['step', 'iteration'] and len(d)
    its = a.step_kinds().set_index('step').iteration
    assert (d.iteration.to_numpy() == d.step.map(its).to_numpy()).all()
    assert set(d.iteration) == set(range(7))


def test_findings_messages_say_iterations_where_they_differ_from_steps(tmp_path):
    db = str(tmp_path / 's.db')
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with torchEmber(m, run='nan', db=db) as te:
        for s in range(12):
            for _ in range(2):
                m(torch.randn(4, 4)).sum().backward()
            if s == 8:
                with torch.no_grad(): m[2].weight.fill_(float('nan'))
            opt.step(); opt.zero_grad()
    f = load('nan', db).diagnose()
    row = f[f.kind == 'nonfinite'].iloc[0]
    assert row.step == 18 and row.iteration == 9
    assert 'step 18 (iteration 9)' in row.message


def test_iteration_by_hand_and_on_resume(tmp_path):
    db = str(tmp_path / 's.db')
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    te = torchEmber(m, run='hand', db=db)
    te.iteration = 100
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    assert te.iteration == 101
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    te.disarm()
    opt.step()
    assert te.iteration == 102                                             # disarmed: no longer counted
    with pytest.raises(ValueError, match='iteration'): te.iteration = -1
    te2 = torchEmber(m, run='hand', db=db, resume=True)
    m(torch.randn(2, 4)).sum().backward(); opt.step()
    te2.disarm()
    assert load('hand', db).steps().iteration.tolist() == [100, 101, 102]   # on from the optimizer step after the last


def test_counting_never_raises_into_the_optimizer(tmp_path):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    te = torchEmber(m, run='odd', db=str(tmp_path / 's.db'))
    m(torch.randn(2, 4)).sum().backward()
    opt.param_groups.append({'params': None, 'lr': 0.1})                 # a param group counting cannot read
    try: opt.step()
    except TypeError: pass                                                 # SGD's own complaint, if any, is SGD's
    te.disarm()


def test_a_train_mode_call_of_a_frozen_model_is_no_grad(tmp_path):
    m = mlp().requires_grad_(False)
    with torchEmber(m, run='frozen', db=str(tmp_path / 's.db')) as te:
        m(torch.randn(2, 4))
    assert load('frozen', str(tmp_path / 's.db')).steps().kind.tolist() == ['no_grad']
