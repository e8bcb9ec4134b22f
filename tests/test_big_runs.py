"""Long runs (issue 27), on a narrow store of 50,000 steps built as `bench/big.py` builds its big ones: a few steps
recorded, copied forward in SQL.

Checked: a one-step spike of one module's grad norm and a NaN in one step of one module's output stay visible in the
heatmap and in the explorer's history zoomed all the way out (a column of many steps shows its extreme, and is red if
any step held NaN/Inf; the history's envelope), read from the `rollups`, which agree with the rows; zooming re-reads
the range at full resolution; `steps()` reads the global norms the writer summed; thinning keeps what matters; a wide
model's map is folded by its module tree, a folded row showing its modules' extreme, and opens on a click.
"""
import math, sys, warnings
from pathlib import Path
import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa
import torch
from torch import nn
from torchember import load
from torchember.figures import module_map
from torchember.explore import Explorer
from torchember.store import engine

sys.path.insert(0, str(Path(__file__).parent.parent/'bench'))
from big import build

STEPS = 50_000   # 391 columns of 128 steps: the map reads the rollups of 128 steps

@pytest.fixture(scope='module')
def big(tmp_path_factory):
    db = str(tmp_path_factory.mktemp('big')/'big.db')
    spike, nan = build(db, modules=11, steps=STEPS, record=30, name='long')
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

def test_the_history_zoomed_out_shows_the_spike_and_the_nan(big):
    "A line of 2,000 of 50,000 steps misses both; the envelope behind it (every step's extreme, a bin at a time) has them."
    db, spike, nan = big
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        ex = Explorer(db, run='long')
    try:
        ex.select(names(db)[3], 'weight_grad', 'norm')
        tr = {t.name: t for t in ex.plots['history'].data}
        assert spike not in set(ex.history_df['step'])                         # the line's steps skip it
        top = tr['every step: max']
        j = int(np.nanargmax(np.array(top.y, dtype=float)))
        assert top.x[j] <= spike < top.x[j + 1]                                 # the envelope's peak is the spike's bin
        assert top.y[j] > 100 * np.nanmedian(np.array(top.y, dtype=float))
        ex.select(names(db)[5], 'output', 'mean')
        marks = {t.name: t for t in ex.plots['history'].data}['NaN/Inf (every step)']
        assert list(marks.x) == [nan]
        ex.fig.plotly_relayout({'xaxis3.range[0]': spike - 50, 'xaxis3.range[1]': spike + 50}, source_view_id='test')   # a zoom
        ex.select(names(db)[3], 'weight_grad', 'norm')
        h = ex.history_df
        assert h['step'].tolist() == list(range(spike - 50, spike + 51))        # every step of the range
        assert h.loc[h['step'] == spike, 'norm'].item() > 100 * h['norm'].median()
        ex.fig.plotly_relayout({'xaxis3.autorange': True}, source_view_id='test')
        assert len(ex.history_df) == ex.max_points
        ex.fig.plotly_relayout({'xaxis.range[0]': nan - 200, 'xaxis.range[1]': nan + 199}, source_view_id='test')   # the map
        m = ex.map_data
        assert (m['width'], m['x'][0], m['x'][-1]) == (1, nan - 200, nan + 199)
    finally: ex.close()

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)
    def forward(self, x): return x + self.down(self.act(self.up(x)))

class Deep(nn.Module):
    def __init__(self, n=40):
        super().__init__()
        self.layers, self.head = nn.ModuleList(Block() for _ in range(n)), nn.Linear(8, 1)
    def forward(self, x):
        for b in self.layers: x = b(x)
        return self.head(x)

def test_a_wide_map_is_folded_by_the_module_tree(tmp_path):
    "40 blocks of 4 modules: one row a block (numbered as a repeated block), the spike of one inner Linear lit in its block's row."
    from torchember import torchEmber
    from torchember.figures import fold_map, map_labels
    torch.manual_seed(0)
    model, db = Deep(), str(tmp_path/'deep.db')
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    te = torchEmber(model, run='deep', db=db)
    for _ in range(20):
        model(torch.randn(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    te.disarm()
    with engine(db).begin() as c:
        c.exec_driver_sql("UPDATE stats SET norm = norm * 1e4 WHERE step = 10 AND ttype = 'weight_grad' AND "
                          "module_id = (SELECT id FROM modules WHERE name = 'layers.7.down')")
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        ex = Explorer(db, run='deep')
    try:
        m = ex.map_data
        assert set(m['folded']) == {f'layers.{i}' for i in range(40)} and len(m['modules']) == 41   # 40 blocks and the head
        row = m['modules'].index('layers.7')
        assert np.nanargmax(m['z'][:, 10]) == row                                # the block holding the spike is the brightest
        label = next(l for l, n in ex._map_rows.items() if n == 'layers.7')
        assert '▸' in label and 'Block 8/40' in label and '(2 modules)' in label   # the two with weight grads
        ex.unfold('layers.7')
        assert {'layers.7.up', 'layers.7.down'} <= set(ex.map_data['modules']) and 'layers.6' in ex.map_data['folded']
        ex.fold_toggle.value = False
        assert len(ex.map_data['modules']) == 40 * 2 + 1 and not ex.map_data['folded']     # a row per module with grads
    finally: ex.close()

# last: it deletes most of the shared store's rows
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
