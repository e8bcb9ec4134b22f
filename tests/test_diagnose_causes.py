"Issue 50: `diagnose()` names the module that started a blow-up (the cause), not the victim; NaN stays NaN."
import math
import numpy as np
import pandas as pd
import pytest
from causes import CASES

@pytest.fixture(scope='module')
def made(tmp_path_factory):
    "Each known-cause run, made once for the tests of this file."
    out = {}
    def get(name):
        if name not in out: out[name] = CASES[name][0](str(tmp_path_factory.mktemp(name)/'store.db'))
        return out[name]
    return get

@pytest.mark.parametrize('name', list(CASES))
def test_diagnose_names_the_cause_first(name, made):
    _, module, step = CASES[name]
    f = made(name).diagnose()
    first = f.iloc[0]
    assert first['kind'] == 'cause', f[['kind', 'step', 'module', 'ttype']].head()
    assert first['module'] == module and abs(first['step'] - step) <= 2, first['message']
    causes = f[f['kind'] == 'cause']
    assert not ((causes['step'] < first['step']) & (causes['severity'] == first['severity'])).any()   # no earlier cause below it
    named = f[f['module'].notna() & (f.index > 0)]
    # no row above the cause names another module; a module named later is the cause or one that followed it
    assert f.index[f['module'] == module].min() == 0

def test_the_nonfinite_row_says_what_it_followed(made):
    f = made('scaled_weight').diagnose()
    nf = f[f['kind'] == 'nonfinite'].iloc[0]
    assert nf['module'] != 'blocks.1.mlp.proj'                       # the victim, a later LayerNorm...
    assert "it followed module 'blocks.1.mlp.proj'" in nf['message']  # ...says what it followed
    cause = f.iloc[0]
    assert cause['severity'] == 'error' and 'the first NaN' in cause['message']
    assert cause['value'] / float(cause['expected'].split('median ')[1].split(' ')[0]) > 1e3   # by how much: ~1e4x

def test_the_bad_batch_is_the_models_input(made):
    f = made('bad_batch').diagnose()
    assert f.iloc[0][['kind', 'ttype', 'step']].tolist() == ['cause', 'input', 70]
    loss = f[(f['kind'] == 'spike') & (f['stat'] == 'loss')].iloc[0]
    assert loss['step'] == 70 and loss['ttype'] == 'input' and 'the batch' in loss['message']

def test_a_cause_long_before_the_end_is_seen(made):
    "The hot-lr run's cause is 60 steps before its end, past the 50-step window that ends at the last step."
    r = made('hot_lr')
    f = r.diagnose(window=20)
    assert f.iloc[0][['kind', 'module']].tolist() == ['cause', 'conv2']

def test_a_persistent_change_is_one_finding(made):
    f = made('hot_lr').diagnose()
    assert (f['kind'] == 'cause').sum() == 1
    assert (f['module'] == 'conv2').all() or set(f.loc[f['module'] != 'conv2', 'kind']) <= {'dead'}

def test_ignore_causes(made):
    f = made('scaled_weight').diagnose(ignore='cause')
    assert not (f['kind'] == 'cause').any() and f.iloc[0]['kind'] == 'nonfinite'

def test_nan_stays_nan(made):
    "After the blow-up every grad is NaN: df keeps the stat columns, summary shows NaN (not 0.0), last_finite_step is the step before."
    r = made('scaled_weight')
    broke = r.first_nonfinite()['step']
    assert r.last_finite_step() == broke - 1
    d = r.df(step=r.last_step, ttype='weight_grad')
    assert {'mean', 'std', 'min', 'max', 'norm'} <= set(d.columns) and d['norm'].isna().all()
    s = r.summary(step=r.last_step)
    assert s['grad_norm'].isna().all() and not (s['grad_norm'] == 0).any()
    top = r.summary(step='last_finite').nlargest(5, 'grad_norm')     # "the top five by grad norm, before the NaN"
    assert len(top) == 5 and top['grad_norm'].notna().all() and (top['step'] == broke - 1).all()
    assert r.df(step='last_finite')['step'].unique().tolist() == [broke - 1]

def long_run(db, steps=1600, at=900, mods=12, name='long'):
    "A run written as a writer writes it, longer than `FULL_STEPS`, no loss logged: module '5''s output 10x from step `at` on."
    import random
    from torchember.store import engine, create_run, write_steps
    eng = engine(db)
    names = [('', 'Sequential', None)] + [(str(i), 'Linear', 0) for i in range(mods - 1)]
    events = [('enter', 0, 0)] + [e for i in range(1, mods) for e in (('enter', i, 0), ('exit', i, 0))] + [('exit', 0, 0)]
    rid, _ = create_run(eng, name, 'Sequential', names, {})
    def rows(s):
        r = random.Random(s)
        out = []
        for m in range(mods):
            for tt in ('input', 'output', 'weight', 'weight_grad'):
                v = 1.0 + 0.05 * r.random()
                if tt == 'output' and m >= 6 and s >= at: v *= 10   # module '5' (id 6) and the ones after it
                out.append((m, 0, tt, 'weight' if tt.startswith('weight') else tt, '[32, 64]', 'float32',
                            2048.0, 0.1 * v, v, -v, v, 10 * v, 0.0, 0.0, 0.0, None, 8192))
        return out
    for lo in range(0, steps, 100):
        write_steps(eng, rid, [dict(step=s, rows=rows(s), events=events, events_step=None if s == 0 else 0, iteration=s,
                                    kind='train') for s in range(lo, min(lo + 100, steps))])
    from torchember import load
    return load(name, db)

def test_a_long_run_is_judged_where_its_rollups_point(tmp_path):
    "Past FULL_STEPS steps a run is not read whole: the rollups point to the bins that left their bands, read step by step."
    from torchember.diagnose import FULL_STEPS
    r = long_run(str(tmp_path/'long.db'))
    assert r.last_step + 1 > FULL_STEPS
    f = r.diagnose()
    assert f.iloc[0][['kind', 'step', 'module', 'ttype']].tolist() == ['cause', 900, '5', 'output'], f[['kind', 'step', 'module']]
    assert (f['kind'] == 'cause').sum() == 1                              # a change of scale that persists: once, at its start

def test_diagnose_just_before_it_broke(made):
    r = made('scaled_weight')
    f = r.diagnose(step='last_finite')
    assert not (f['kind'] == 'nonfinite').any()
    assert f.iloc[0][['kind', 'module', 'step']].tolist() == ['cause', 'blocks.1.mlp.proj', 60]

def test_on_either_database(store):
    "SQLite stores a NaN norm as NULL, PostgreSQL keeps it NaN: the same cause, NaN rows and step before it on both."
    r = CASES['scaled_weight'][0](store)
    f = r.diagnose()
    assert f.iloc[0][['kind', 'module', 'step', 'ttype']].tolist() == ['cause', 'blocks.1.mlp.proj', 60, 'weight']
    broke = r.first_nonfinite()['step']
    assert r.last_finite_step() == broke - 1 and r.summary(step=r.last_step)['grad_norm'].isna().all()
