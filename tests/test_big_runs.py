"""Long runs (issue 27), on a small store built as `bench/big.py` builds its big ones: a few steps recorded, copied forward in SQL.

Checked: a one-step spike of one module's grad norm and a NaN in one step of one module's output stay visible in the
heatmap zoomed all the way out (a column of many steps shows its extreme, and is red if any step held NaN/Inf), read
from the `rollups`; the same map read row by row (a store without rollups) agrees; `steps()` reads the global norms the
writer summed, equal to summing the rows.
"""
import math, sys
from pathlib import Path
import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa
from torchember import load
from torchember.figures import module_map
from torchember.store import engine

sys.path.insert(0, str(Path(__file__).parent.parent/'bench'))
from big import build

STEPS = 6000   # 500 columns of 12 steps: the map reads the rollups of 8 steps, two a column

@pytest.fixture(scope='module')
def big(tmp_path_factory):
    db = str(tmp_path_factory.mktemp('big')/'big.db')
    spike, nan = build(db, modules=21, steps=STEPS, record=30, name='long')
    return db, spike, nan

def names(db)->dict:
    "module id -> name, as the store keeps them."
    with engine(db).connect() as c:
        return dict(c.exec_driver_sql("SELECT m.id, m.name FROM modules m JOIN runs r ON r.id = m.run_id WHERE r.name = 'long'").all())

def column(m, step):
    return next(j for j, x in enumerate(m['x']) if x <= step < x + m['width'])

def test_a_one_step_spike_stays_visible_zoomed_out(big):
    db, spike, _ = big
    m = module_map(load('long', db), ttype='weight_grad', stat='norm')
    assert len(m['x']) <= 500 and m['width'] > 1
    row = m['z'][m['modules'].index(names(db)[3])]
    assert np.nanargmax(row) == column(m, spike)                      # the bright cell is the spike's column
    assert np.nanmax(row) > 100 * np.nanmedian(row)

def test_a_nan_in_one_step_stays_red_zoomed_out(big):
    db, _, nan = big
    m = module_map(load('long', db), ttype='output', stat='mean')
    bad = np.argwhere(m['bad'])
    assert [tuple(b) for b in bad] == [(m['modules'].index(names(db)[5]), column(m, nan))]

def test_rollups_agree_with_the_rows(big):
    "Each column of the map from `rollups` is the extreme over its steps of the module's per-step value, computed here from every row."
    db, _, _ = big
    run = load('long', db)
    g = run.df(ttype='weight_grad')
    per_step = g.assign(sq=g['norm'] ** 2, sd=g['std'] ** 2 * g['numel'], mn=g['mean'] * g['numel']).groupby(['module', 'step'])
    per_step = per_step.agg(sq=('sq', 'sum'), sd=('sd', 'sum'), mn=('mn', 'sum'), n=('numel', 'sum'), hi=('max', 'max'), lo=('min', 'min'))
    for stat, want in (('norm', np.sqrt(per_step['sq'])), ('std', np.sqrt(per_step['sd'] / per_step['n'])),
                       ('max', per_step['hi']), ('min', per_step['lo'])):
        m = module_map(run, ttype='weight_grad', stat=stat)
        assert m['width'] > 8                                        # read from the rollups (see `_extremes`)
        col = (want.index.get_level_values('step') // m['width']).to_numpy()
        frame = pd.DataFrame({'module': want.index.get_level_values('module'), 'col': col, 'v': want.to_numpy()})
        ref = frame.groupby(['module', 'col'])['v'].agg('min' if stat == 'min' else 'max')
        for (module, j), v in ref.items():
            np.testing.assert_allclose(m['z'][m['modules'].index(module), j], v, rtol=1e-9, err_msg=f'{stat} {module} {j}')

def test_steps_read_the_global_norms_the_writer_summed(big):
    db, _, _ = big
    st = load('long', db).steps()
    first = st[st['step'] < 30]                                      # the recorded steps, summed by the writer
    df = load('long', db).df(ttype='weight_grad', steps=(0, 29))
    want = df.groupby('step')['norm'].apply(lambda v: math.sqrt((v ** 2).sum()))
    np.testing.assert_allclose(first.set_index('step')['grad_norm'].loc[want.index], want, rtol=1e-12)

def test_the_first_nan_is_found_through_the_rollups(big):
    "The rollups name the step; the rows there say which call: the same answer as scanning every row."
    db, _, nan = big
    run = load('long', db)
    seen = []
    spy = lambda conn, cursor, statement, *a: seen.append(statement)
    sa.event.listen(engine(db), 'before_cursor_execute', spy)
    try: first = run.first_nonfinite()
    finally: sa.event.remove(engine(db), 'before_cursor_execute', spy)
    assert (first['step'], first['module'], first['ttype']) == (nan, '4', 'output')
    assert not any('FROM stats' in q and 'nan_count > ' in q and 'min(stats.step)' in q for q in seen)   # no scan for the step
    assert run.first_nonfinite(after=-1) == first                                                     # the scan agrees

def test_thinning_keeps_the_spike_the_nan_and_every_steps_norms(big):
    "After keeping one step in 100 (and those with findings), the map still shows the spike and the NaN; steps keep their norms."
    db, spike, nan = big
    run = load('long', db)
    norms = run.steps()['grad_norm']
    before = module_map(run, ttype='weight_grad', stat='norm')
    named = set(run.diagnose()['step'].dropna().astype(int))
    gone = run.thin(every=100)
    left = sorted(load('long', db).df(ttype='output')['step'].unique())
    assert gone['stats'] > 0 and len(left) <= STEPS // 100 + len(named)
    assert all(k % 100 == 0 or k in named for k in left) and nan in left            # the NaN's step has a finding: kept
    after = module_map(run, ttype='weight_grad', stat='norm')
    np.testing.assert_array_equal(after['z'], before['z'])                            # read from the rollups, which stay
    assert load('long', db).steps()['grad_norm'].equals(norms)
