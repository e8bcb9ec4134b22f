"Issue 20: `Run.diagnose` names the culprit of models made to misbehave; `diff` finds where two runs part; the `doctor` and `diff` commands."
import subprocess, sys
import pytest, torch
import pandas as pd
from torch import nn
from corpus import CORPUS, loss_of
import torchember as te
from torchember import torchEmber, load, diff

def mlp(depth=4, width=16, act=nn.ReLU):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), act())], nn.Linear(width, 1))

def train(model, run, db, steps=60, opt=None, tweak=None, **kw):
    "Fit a fixed random linear map for `steps` steps, recorded as `run` with the loss logged; `tweak(step, model)` runs before each forward."
    g = torch.Generator().manual_seed(1)
    target = torch.randn(model[0].in_features, 1, generator=g) / model[0].in_features ** .5
    opt = opt or torch.optim.Adam(model.parameters(), lr=3e-3)
    with torchEmber(model, run=run, db=db, overwrite=True, **kw) as e:
        for s in range(steps):
            if tweak: tweak(s, model)
            x = torch.randn(32, model[0].in_features, generator=g)
            loss = nn.functional.mse_loss(model(x), x @ target)
            opt.zero_grad(); loss.backward(); opt.step()
            e.log(loss=loss)
    return load(run, db)

def scale_up(s, m):
    if s == 40:
        with torch.no_grad(): m[6].weight.mul_(10)

def nudge(s, m):
    if s == 15:
        with torch.no_grad(): m[2].weight.add_(1e-3)

def poison(s, m):
    if s == 12:
        with torch.no_grad(): m[2].weight.fill_(float('nan'))

def test_spike_names_the_scaled_layer_and_step(store):
    f = train(mlp(), 'scaled', store, tweak=scale_up).diagnose()
    loss = f[(f['kind'] == 'spike') & (f['stat'] == 'loss')].iloc[0]
    assert (loss['step'], loss['module'], loss['ttype'], loss['severity']) == (40, '6', 'weight', 'warning')   # its weight was scaled
    assert "it followed module '6' (Linear), its weight RMS at step 40, at the same step" in loss['message']
    own = f.iloc[0]
    assert (own['kind'], own['step'], own['module'], own['ttype']) == ('cause', 40, '6', 'weight')
    assert list(f.columns) == ['kind', 'severity', 'step', 'iteration', 'module', 'mtype', 'ttype', 'tname', 'stat', 'value', 'expected', 'message']

def test_spike_window_ending_before_it_sees_none(db):
    r = train(mlp(), 'scaled', db, tweak=scale_up)
    assert not (r.diagnose(step=39)['kind'] == 'spike').any()

def test_dead_relu_behind_negative_bias(db):
    def neg_bias(s, m):
        if s == 0:
            with torch.no_grad(): m[0].bias.fill_(-100)
    f = train(mlp(), 'dead', db, steps=30, tweak=neg_bias).diagnose()
    assert f.loc[f['kind'] == 'dead', ['module', 'mtype', 'step']].values.tolist() == [['1', 'ReLU', 0]]

def test_vanishing_in_deep_sigmoid_stack(db):
    f = train(mlp(depth=12, act=nn.Sigmoid), 'sigmoid', db, steps=20).diagnose()
    v = f[f['kind'] == 'vanishing']
    assert len(v) == 1 and v['mtype'].iloc[0] == 'Linear' and v['module'].iloc[0] in {str(i) for i in range(0, 24, 2)}
    assert not (f['kind'] == 'exploding').any()

def test_update_ratio_names_the_hot_param_group(db):
    m = mlp()
    opt = torch.optim.Adam([{'params': m[0].parameters(), 'lr': 0.5}, {'params': m[2:].parameters(), 'lr': 1e-3}])
    f = train(m, 'hot-lr', db, steps=30, opt=opt, track_updates=True).diagnose()
    assert f.loc[f['kind'] == 'update_ratio', 'module'].tolist() == ['0']
    assert (f.loc[f['kind'] == 'update_ratio', 'value'] > 0.03).all()

def test_nonfinite_is_an_error_first(db):
    f = train(mlp(), 'nan', db, steps=20, tweak=poison).diagnose()
    assert f.iloc[0][['kind', 'severity', 'step', 'module']].tolist() == ['nonfinite', 'error', 12, '2']

@pytest.mark.parametrize('name', list(CORPUS))
def test_healthy_corpus_run_has_no_errors(name, db):
    model, make_batch = CORPUS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torchEmber(model, run=name, db=db, track_updates=True) as e:
        for s in range(30):
            args, kwargs = make_batch(s)
            loss = loss_of(model(*args, **kwargs))
            opt.zero_grad(); loss.backward(); opt.step()
            e.log(loss=loss)
    f = load(name, db).diagnose()
    print(f"{name}: {len(f)} findings: {f['kind'].value_counts().to_dict()}")
    assert not (f['severity'] == 'error').any()
    assert (f['severity'] == 'warning').sum() <= 3, f[['kind', 'step', 'module', 'message']].to_string()

def test_runs_without_grads_or_steps(db):
    m = mlp()
    with torchEmber(m, run='eval', db=db), torch.no_grad():
        for _ in range(5): m(torch.randn(4, 16))
    f = load('eval', db).diagnose()
    assert list(f.columns)[:3] == ['kind', 'severity', 'step'] and not (f['severity'] == 'error').any()
    torchEmber(mlp(), run='empty', db=db).disarm()
    assert load('empty', db).diagnose().empty

def test_diff_first_divergence(store):
    for run, tweak in (('base', None), ('same', None), ('nudged', nudge)): train(mlp(), run, store, steps=25, tweak=tweak)
    d = diff('base', 'nudged', store)
    assert d.iloc[0][['step', 'module', 'ttype']].tolist() == [15, '2', 'output']
    assert d['step'].min() == 15 and list(d.columns) == ['step', 'iteration', 'module', 'mtype', 'ttype', 'tname', 'stat', 'a', 'b']
    assert diff('base', 'same', store).empty

def test_diff_rtol(db):
    for run, tweak in (('base', None), ('nudged', nudge)): train(mlp(), run, db, steps=25, tweak=tweak)
    assert diff('base', 'nudged', db, rtol=0.5).empty          # the nudge stays small
    loose = diff('base', 'nudged', db, rtol=1e-3)
    assert len(loose) and loose['step'].min() >= 15 and len(loose) < len(diff('base', 'nudged', db))

def test_diff_across_stores_and_max_steps(tmp_path):
    a, b = str(tmp_path/'a.db'), str(tmp_path/'b.db')
    train(mlp(), 'r', a, steps=25); train(mlp(), 'r', b, steps=25, tweak=nudge)
    d = diff('r', 'r', db=a, db_b=b, max_steps=2)
    assert sorted(d['step'].unique()) == [15, 16] and d.iloc[0]['module'] == '2'
    assert diff('r', 'r', db=a, db_b=a).empty

def test_diff_refuses_unknown_run(db):
    train(mlp(), 'base', db, steps=3)
    with pytest.raises(KeyError, match="no run named 'nope'"): diff('base', 'nope', db)

def cli(*args):
    return subprocess.run([sys.executable, '-m', 'torchember.cli', *args], capture_output=True, text=True, timeout=300)

def test_cli_doctor_exit_codes(db):
    train(mlp(), 'ok', db, steps=20); train(mlp(), 'nan', db, steps=20, tweak=poison)
    ok, bad = cli('doctor', 'ok', '--db', db), cli('doctor', 'nan', '--db', db)
    assert ok.returncode == 0, ok.stderr
    assert bad.returncode == 1 and 'nonfinite' in bad.stdout and "module '2'" in bad.stdout
    assert cli('doctor', 'nope', '--db', db).returncode == 2
    quiet = cli('doctor', 'nan', '--db', db, '--ignore', 'nonfinite, spike')   # judged harmless: no error left
    assert quiet.returncode == 0 and 'nonfinite' not in quiet.stdout, quiet.stdout
    assert cli('doctor', 'nan', '--db', db, '--ignore', 'nan').returncode == 2   # not a kind: refused

def test_cli_diff(db):
    for run, tweak in (('base', None), ('nudged', nudge)): train(mlp(), run, db, steps=20, tweak=tweak)
    p = cli('diff', 'base', 'nudged', '--db', db)
    assert p.returncode == 0 and p.stdout.splitlines()[1].split()[:3] == ['15', '15', '2']
    same = cli('diff', 'base', 'base', '--db', db, '--rtol', '0.1')
    assert 'agree within rtol=0.1' in same.stdout

def crafted(db, name, modules, change=None, steps=range(6), skip=()):
    "Write run `name` of `modules` (names, in id order) to store `db`: each module's output, weight and bias rows, edited by `change(step, module, tname, stats)`; rows `(step, module, tname)` in `skip` left out."
    from torchember.store import engine, create_run, write_step
    eng = engine(db)
    rid, _ = create_run(eng, name, 'Sequential', [(n, 'Sequential' if n == '' else 'Linear', None if n == '' else 0) for n in modules], {}, overwrite=True)
    ev = [e for i in range(len(modules)) for e in (('enter', i, 0), ('exit', i, 0))]
    for s in steps:
        rows = []
        for i, m in enumerate(modules):
            for tt, tn in (('output', 'output'), ('weight', 'weight'), ('weight', 'bias')):
                if (s, m, tn) in skip: continue
                k = sum(map(ord, m + tn)) + s
                st = dict(numel=64.0, mean=0.01 * (k % 7 - 3), std=1.0 + 0.1 * (k % 5), min=-3.0, max=3.0 + s, norm=8.0 + k % 11,
                          zero_frac=0.0, nan_count=0.0, inf_count=0.0)
                if change: change(s, m, tn, st)
                rows.append((i, 0, tt, tn, '[8, 8]', 'float32', *st.values(), None, 256))
        write_step(eng, rid, s, rows, ev, events_step=None if s == steps[0] else steps[0])

def nan_std(s, m, tn, st):
    if (s, m, tn) == (1, '1', 'output'): st['std'] = float('nan')      # in both runs: NaN equals NaN

def edits(s, m, tn, st):
    "Run b's changes: a mean 30% off, a NaN against a number, an Inf, a mean near 0 that stays within its std."
    nan_std(s, m, tn, st)
    if (s, m, tn) == (2, '0', 'output'): st['mean'] *= 1.3
    if (s, m, tn) == (3, '2', 'weight'): st['norm'] = float('nan')
    if (s, m, tn) == (4, '0', 'bias'): st['max'] = float('inf')
    if (s, m, tn) == (4, '2', 'output'): st['mean'] = 1e-3

def test_diff_in_store_equals_across_stores(store, tmp_path):
    "One store: the database compares the rows; two stores: pandas does. Same answers, NaN, Inf and one-sided rows included."
    two, three = str(tmp_path/'two.db'), str(tmp_path/'three.db')
    mods = ['', '0', '1', '2']
    for db in (store, two): crafted(db, 'x', mods, nan_std)
    for db in (store, three):
        crafted(db, 'y', ['', '2', '1', '0', '3'], edits, skip={(5, '1', 'bias')})           # other module ids, one more module, a row less
        crafted(db, 'z', mods, edits, steps=range(1, 7), skip={(3, '2', 'bias')})           # the same ids; no step 0, a step 6
    for other in ('y', 'z'):
        for rtol in (0.0, 0.1, 0.5, 2.0):
            for max_steps in (None, 2):
                one, apart = diff('x', other, store, rtol=rtol, max_steps=max_steps), diff('x', other, two, rtol=rtol, db_b=three, max_steps=max_steps)
                pd.testing.assert_frame_equal(one, apart)
    d = diff('x', 'z', store, max_steps=None)
    rows = lambda d, step: d.loc[d['step'] == step, ['module', 'tname', 'stat', 'a', 'b']].values.tolist()
    assert rows(d, 0)[0][2:] == ['row', 1.0, 0.0] and len(rows(d, 0)) == 12 and len(rows(d, 6)) == 12   # steps one run lacks
    assert 1 not in set(d['step'])                                                                      # NaN equals NaN
    assert rows(d, 3)[0] == ['2', 'bias', 'row', 1.0, 0.0] and rows(d, 3)[1][:3] == ['2', 'weight', 'norm'] and pd.isna(rows(d, 3)[1][4])
    loose = diff('x', 'z', store, rtol=0.5, max_steps=None)
    assert set(loose['step']) == {0, 3, 6}   # the 30% mean, the Inf and the mean within its std pass rtol=0.5
    (m, tn, stat, a, b), = rows(d, 2)
    assert (m, tn, stat, b) == ('0', 'output', 'mean', a * 1.3)
    y = diff('x', 'y', store, rtol=0.1, max_steps=None)   # the 30% are within 0.1 of the std; module '3' is y's only
    assert set(y.loc[y['module'] == '3', 'stat']) == {'row'} and ['1', 'bias', 'row', 1.0, 0.0] in rows(y, 5)
    assert 2 not in set(y.loc[y['module'] != '3', 'step'])

def test_gradscaler_overflows_are_a_warning_and_doctor_passes(store):
    "AMP's GradScaler skips steps whose grads overflow: only grads held Inf, so the run is healthy (a warning); a NaN weight stays an error."
    m = mlp()
    opt, scaler = torch.optim.SGD(m.parameters(), lr=0.01), torch.amp.GradScaler('cpu', init_scale=2.**127)
    with torchEmber(m, run='amp', db=store) as e:
        for s in range(20):
            loss = nn.functional.mse_loss(m(torch.randn(32, 16)), torch.full((32, 1), 10.))
            opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
            e.log(loss=loss)
    f = load('amp', store).diagnose()
    assert f.iloc[0][['kind', 'severity', 'step']].tolist() == ['nonfinite', 'warning', 0] and 'GradScaler' in f.iloc[0]['message']
    assert not (f['severity'] == 'error').any()
    assert cli('doctor', 'amp', '--db', store).returncode == 0
    f = train(mlp(), 'nan', store, steps=20, tweak=poison).diagnose()   # the weights went NaN too: still an error
    assert f.iloc[0][['kind', 'severity']].tolist() == ['nonfinite', 'error']

def test_diff_finds_what_step_sums_miss_by_the_writers_digests(store):
    "Two means swapped between two rows leave every per-step sum equal: the digests the writer stored still tell the step."
    from torchember.diagnose import step_digests, fingerprints
    def base(s, m, tn, st, sign=1):   # step 3's means: 0, but +-0.5 in two rows (exact sums in any order)
        if s == 3: st['mean'] = sign * {('0', 'output'): -0.5, ('2', 'output'): 0.5}.get((m, tn), 0.0)
    def swap(s, m, tn, st): base(s, m, tn, st, -1)
    crafted(store, 'x', ['', '0', '1', '2'], base); crafted(store, 'w', ['', '0', '1', '2'], swap)
    a, b = load('x', store), load('w', store)
    fa, fb = fingerprints(a, 0, 5), fingerprints(b, 0, 5)
    assert fa.equals(fb)                                                 # the sums cannot see it
    assert (step_digests(a, 0, 5)['digest'] != step_digests(b, 0, 5)['digest']).tolist() == [False] * 3 + [True] + [False] * 2
    d = diff('x', 'w', store)
    assert sorted(d[['step', 'module', 'stat']].values.tolist()) == [[3, '0', 'mean'], [3, '2', 'mean']]

def test_diff_after_late_rows_and_without_digests(store):
    "Rows written after their step closed (late grads) and steps stored before digests make those steps be compared the long way."
    from torchember.store import engine, write_step, digests_t
    from torchember.diagnose import step_digests
    crafted(store, 'x', ['', '0', '1', '2']); crafted(store, 'z', ['', '0', '1', '2'], edits)
    a, z = load('x', store), load('z', store)
    assert step_digests(a, 0, 5) is not None
    late = (2, 0, 'weight_grad', 'weight', '[8, 8]', 'float32', 64.0, 0.0, 1.0, -1.0, 1.0, 5.0, 0.0, 0.0, 0.0, None, 256)
    write_step(engine(store), a.id, 1, [late], closed=False)            # only run x gets a late row at step 1
    assert step_digests(a, 0, 5) is None
    d = diff('x', 'z', store, max_steps=None)
    assert [1, '1', 'row', 1.0, 0.0] in d[['step', 'module', 'stat', 'a', 'b']].values.tolist()
    with engine(store).begin() as c: c.execute(digests_t.delete().where(digests_t.c.run_id == z.id))   # z as an older store wrote it
    pd.testing.assert_frame_equal(diff('x', 'z', store, max_steps=None), d)

def gan(db, iters=100, seed=0, scale_d_at=None):
    "A tiny GAN: the discriminator is called three times an iteration (a real batch, then two fake ones), so one step in three of its run differs from the other two."
    torch.manual_seed(seed)
    G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    D = nn.Sequential(nn.Linear(4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    og, od, bce = torch.optim.Adam(G.parameters(), 2e-4), torch.optim.Adam(D.parameters(), 2e-4), nn.BCEWithLogitsLoss()
    with torchEmber(G, run='G', db=db, overwrite=True), torchEmber(D, run='D', db=db, overwrite=True):
        for i in range(iters):
            if i == scale_d_at:
                with torch.no_grad(): D[0].weight.mul_(8)
            real, fake = torch.randn(16, 4) + 2, G(torch.randn(16, 8))
            ld = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
            od.zero_grad(); ld.backward(); od.step()
            lg = bce(D(fake), torch.ones(16, 1))
            og.zero_grad(); lg.backward(); og.step()
    return load('G', db), load('D', db)

@pytest.mark.parametrize('seed', [0, 1, 2])
def test_a_level_seen_every_few_steps_is_no_spike(db, seed):
    "A healthy GAN: the discriminator's real-batch steps are not spikes of its first layer (10 warnings in 30 iterations before)."
    for r in gan(db, seed=seed): assert r.diagnose().empty, r.diagnose()[['kind', 'step', 'module', 'message']]

def test_a_real_spike_in_a_periodic_run_is_still_found(db):
    _, d = gan(db, scale_d_at=90)    # its real-batch call is step 270, in the window diagnose looks at
    f = d.diagnose()
    assert f.iloc[0][['kind', 'step', 'module', 'ttype']].tolist() == ['cause', 270, '0', 'weight'], f[['kind', 'step', 'module', 'message']]

def fit(db, run, batch=lambda i, g: torch.randn(32, 16, generator=g), after=None, steps=200):
    "SGD of `mlp()` on x -> x[:, :1] for `steps` steps of `batch(i, g)`, recorded as `run`; `after(i, m, g)` runs after each step."
    m = mlp()
    opt, g = torch.optim.SGD(m.parameters(), lr=0.01), torch.Generator().manual_seed(0)
    with torchEmber(m, run=run, db=db):
        for i in range(steps):
            m.train()
            x = batch(i, g)
            loss = nn.functional.mse_loss(m(x), x[:, :1])
            opt.zero_grad(); loss.backward(); opt.step()
            if after: after(i, m, g)
    return load(run, db)

def test_validation_steps_are_not_spikes(db):
    "Eval-mode calls are steps too (bigger batches, other data): diagnose judges training steps against training steps."
    def validate(i, m, g):
        if i % 40 != 39: return
        m.eval()
        with torch.no_grad():
            for _ in range(5): m(torch.randn(256, 16, generator=g) * 3)
    r = fit(db, 'val', after=validate)
    assert (r.steps()['training'] == 0).sum() == 25
    assert r.diagnose().empty, r.diagnose()[['kind', 'step', 'module', 'message']]

def test_a_smaller_last_batch_is_no_spike_of_outputs(db):
    "Outputs are judged by their RMS (norm / √elements): a last batch of an epoch 16x smaller moves no output band."
    f = fit(db, 'ragged', batch=lambda i, g: torch.randn(4 if i % 25 == 24 else 64, 16, generator=g)).diagnose()
    assert not ((f['kind'] == 'spike') & (f['ttype'] == 'output')).any(), f[['kind', 'step', 'module', 'ttype', 'message']]

def test_dead_names_the_module_that_made_the_zeros_not_those_that_pass_them_on(db):
    "A Dropout and a Flatten after a dead ReLU are handed zeros: only the ReLU is dead, and its message counts the others."
    def neg_bias(s, m):
        if s == 0:
            with torch.no_grad(): m[0].bias.fill_(-100)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.1), nn.Flatten(), nn.Linear(16, 1))
    f = train(m, 'passed', db, steps=30, tweak=neg_bias).diagnose()
    dead = f[f['kind'] == 'dead']
    assert dead[['module', 'mtype']].values.tolist() == [['1', 'ReLU']], f[['kind', 'module', 'message']]
    assert '2 more outputs of zeros, from modules handed only zeros, not listed' in dead['message'].iloc[0]
