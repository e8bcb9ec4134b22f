"""A store whose rollups lack bins (issue 47): folded for its first steps only, with a stretch unfolded in the middle
too, as a writer that stopped folding or an older torchember leaves one. Built as `bench/big.py` builds its stores: a
few steps recorded, copied forward in SQL, on SQLite and on PostgreSQL.

Checked: the views (the map, a module's envelope, the first NaN the explorer looks for) read a bounded sample of the
steps the rollups lack, not their rows, and mark the columns so read; a sampled column is the rows at its step;
`Run.roll_up()` folds only the bins missing, a bounded span a statement, after which the views are exact and show
the spike and the NaN planted in the unfolded steps; on a store so folded it does no work.
"""
import re, sys, time
from contextlib import contextmanager
from pathlib import Path
import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa
from torchember import load
from torchember.figures import module_map, module_envelope
from torchember.store import engine

sys.path.insert(0, str(Path(__file__).parent.parent/'bench'))
from big import build

STEPS, FOLDED, HOLE = 30_000, 8192, (2048, 4095)   # folded: steps 0..8191 but the hole; unfolded: the hole, 8192..29999

@pytest.fixture
def gaps(store):
    "A run of `STEPS` steps whose rollups cover steps 0..`FOLDED`-1 but `HOLE`; its spike and NaN lie in the unfolded steps."
    spike, nan = build(store, modules=11, steps=STEPS, record=30, name='gaps', folded=FOLDED)
    with engine(store).begin() as c:
        rid = c.exec_driver_sql("SELECT id FROM runs WHERE name = 'gaps'").scalar()
        c.exec_driver_sql(f"DELETE FROM rollups WHERE run_id = {rid} AND bin * width BETWEEN {HOLE[0]} AND {HOLE[1]}")
    if engine(store).dialect.name == 'postgresql':   # what autovacuum does to a table that grew: its planner then seeks named steps
        with engine(store).connect().execution_options(isolation_level='AUTOCOMMIT') as c: c.exec_driver_sql('ANALYZE')
    assert spike > FOLDED and nan > FOLDED
    return store, spike, nan

def per_step(run, ttype:str, steps=None)->pd.DataFrame:
    "Each module's per-step values (its tensors together) at `steps`, from the rows: norm, and the mean by element count."
    g = run.df(ttype=ttype, step=steps) if steps is not None else run.df(ttype=ttype)
    g = g.assign(sq=g['norm'] ** 2, mn=g['mean'] * g['numel'])
    out = g.groupby(['module', 'step']).agg(sq=('sq', 'sum'), mn=('mn', 'sum'), n=('numel', 'sum'), nan=('nan_count', 'sum'))
    return out.assign(norm=np.sqrt(out['sq']), mean=out['mn'] / out['n'])

@contextmanager
def stats_reads(db):
    "`[n]`: the rows of `stats` read inside (PostgreSQL: the server's count; SQLite: thousands of VM steps of the statements reading it)."
    out, eng = [0], engine(db)
    if eng.dialect.name == 'postgresql':
        def read():
            eng.dispose()   # the server counts a connection's reads when it ends
            with sa.create_engine(eng.url, poolclass=sa.pool.NullPool).connect() as c:
                for _ in range(50):   # a backend ending reports its counts a moment later
                    c.exec_driver_sql('SELECT pg_stat_clear_snapshot()')
                    n = c.exec_driver_sql("SELECT seq_tup_read + COALESCE(idx_tup_fetch, 0) FROM pg_stat_user_tables "
                                          "WHERE relname = 'stats'").scalar()
                    if _ and n == last: return n
                    last = n
                    time.sleep(0.1)
            return n
        before = read()
        yield out
        out[0] = read() - before
        return
    state = dict(on=False)
    def tick():
        if state['on']: out[0] += 1
        return 0
    def spy(conn, cursor, statement, *a):   # a statement runs, then its rows are fetched, until the next one
        state['on'] = bool(re.search(r'\b(FROM|JOIN) stats\b', statement))
        conn.connection.driver_connection.set_progress_handler(tick, 1000)
    sa.event.listen(eng, 'before_cursor_execute', spy)
    try: yield out
    finally:
        sa.event.remove(eng, 'before_cursor_execute', spy)
        state['on'] = False
        with eng.connect() as c: c.connection.driver_connection.set_progress_handler(None, 1)

def unfolded_rows(db, run)->tuple:
    "`(rows, what reading them counts)`: the stats rows of the steps the rollups lack, and `stats_reads` of a read of them all."
    where = f"run_id = {int(run.id)} AND (step BETWEEN {HOLE[0]} AND {HOLE[1]} OR step >= {FOLDED})"
    with stats_reads(db) as full:
        with engine(db).connect() as c: n = c.exec_driver_sql(f"SELECT COUNT(norm) FROM stats WHERE {where}").scalar()
    return n, full[0]

def test_views_read_a_bounded_sample_where_bins_are_missing(gaps):
    "The map, an envelope and the first-NaN search read under a tenth of what reading the unfolded rows once costs."
    db, _, nan = gaps
    run = load('gaps', db)
    n, full = unfolded_rows(db, run)
    assert n > 30 * (STEPS - FOLDED)
    with stats_reads(db) as seen:
        m = module_map(run, ttype='weight_grad', stat='norm')
        o = module_map(run, ttype='output', stat='mean')
        e = module_envelope(run, '4', 'output', stat='mean')
    assert seen[0] < full / 10, (seen[0], full)
    with stats_reads(db) as seen: run.first_nonfinite(sample=True)   # the explorer's search for the first NaN
    assert seen[0] < full / 10, (seen[0], full)
    assert run.unfolded() == [HOLE, (FOLDED, STEPS - 1)]
    x = np.asarray(m['x'])
    gap = ((x >= HOLE[0]) & (x + m['width'] - 1 <= HOLE[1])) | (x >= FOLDED)
    assert m['sampled'].tolist() == gap.tolist() and o['sampled'].tolist() == gap.tolist()   # the folded columns: not sampled
    assert e['sampled'].tolist() == gap.tolist()

def test_a_sampled_column_is_the_rows_at_its_step(gaps):
    "Where the rollups lack bins a column shows its first step's values; where they have them, its steps' extremes."
    db, _, _ = gaps
    run = load('gaps', db)
    for ttype, stat in (('weight_grad', 'norm'), ('output', 'mean')):
        m = module_map(run, ttype=ttype, stat=stat)
        x, w = np.asarray(m['x']), m['width']
        some = np.flatnonzero(m['sampled'])[::25]
        want = per_step(run, ttype, x[some].tolist())[stat]
        for j in some:
            for module, v in want.xs(int(x[j]), level='step').items():
                np.testing.assert_allclose(m['z'][m['modules'].index(module), j], v, rtol=1e-9, err_msg=f'{stat} {module} {x[j]}')
        folded = np.flatnonzero(~m['sampled'])[:3]   # the first columns: rollups, the extreme of every step
        rows = per_step(run, ttype, [s for j in folded for s in range(x[j], x[j] + w)])[stat]
        for j in folded:
            col = rows[(rows.index.get_level_values('step') >= x[j]) & (rows.index.get_level_values('step') < x[j] + w)]
            ext = col.abs().groupby(level='module').max() if stat == 'mean' else col.groupby(level='module').max()
            for module, v in ext.items():
                np.testing.assert_allclose(abs(m['z'][m['modules'].index(module), j]) if stat == 'mean' else m['z'][m['modules'].index(module), j],
                                           v, rtol=1e-9)

def test_roll_up_folds_only_the_missing_bins_then_the_views_are_exact(gaps):
    "`roll_up()` folds the hole and the tail, at most 2,048 steps a statement; the spike and NaN show; again, it does nothing."
    db, spike, nan = gaps
    run = load('gaps', db)
    folds = []
    spy = lambda conn, cursor, statement, *a: folds.append(statement) if 'INSERT INTO rollups' in statement and 'FROM stats' in statement else None
    sa.event.listen(engine(db), 'before_cursor_execute', spy)
    try: run.roll_up()
    finally: sa.event.remove(engine(db), 'before_cursor_execute', spy)
    spans = [tuple(map(int, re.search(r'step BETWEEN (\d+) AND (\d+)', q).groups())) for q in folds]
    assert spans and all(b - a + 1 <= 2048 for a, b in spans)                          # bounded statements
    assert all(HOLE[0] <= a and b <= HOLE[1] or a >= FOLDED for a, b in spans)       # nothing folded twice
    assert sum(b - a + 1 for a, b in spans) == HOLE[1] - HOLE[0] + 1 + STEPS - FOLDED
    assert run.unfolded() == []
    m = module_map(run, ttype='weight_grad', stat='norm')
    assert not m['sampled'].any()
    with engine(db).connect() as c:
        spiked = c.exec_driver_sql(f"SELECT name FROM modules WHERE run_id = {int(run.id)} AND id = 3").scalar()
    row = m['z'][m['modules'].index(spiked)]
    j = int(np.nanargmax(row))
    assert m['x'][j] <= spike < m['x'][j] + m['width'] and np.nanmax(row) > 100 * np.nanmedian(row)
    o = module_map(run, ttype='output', stat='mean')
    assert [o['x'][j] <= nan < o['x'][j] + o['width'] for j in np.flatnonzero(o['bad'].any(0))] == [True]
    assert run.first_nonfinite(sample=True)['step'] == nan == run.first_nonfinite(after=-1)['step']
    seen = []   # called again, on a store now folded: it writes nothing and reads no stats row
    spy = lambda conn, cursor, statement, *a: seen.append(statement)
    sa.event.listen(engine(db), 'before_cursor_execute', spy)
    try:
        with stats_reads(db) as reads: run.roll_up()
    finally: sa.event.remove(engine(db), 'before_cursor_execute', spy)
    assert not [q for q in seen if re.match(r'\s*(INSERT|UPDATE|DELETE)', q)]
    assert not [q for q in seen if re.search(r'\b(FROM|JOIN) stats\b', q)]
    assert reads[0] == 0

def test_the_explorer_says_where_it_sampled(gaps):
    "Opened on such a store, the explorer's map is shaded where sampled, and its title and status line say from where."
    import warnings
    from torchember.explore import Explorer
    db, _, _ = gaps
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        ex = Explorer(db, run='gaps')
    try:
        assert ex.map_data['sampled'].any()
        assert f"steps {HOLE[0]}– sampled: no rollups there (run.roll_up() folds them)" in ex.status.value
        assert 'sampled at steps' in ex.plots['map'].title
        assert [s.name for s in ex.fig.layout.shapes].count('map:sampled') == 2   # the hole and the steps after the folded ones
    finally: ex.close()

def plant(db, run, step:int, module_id:int, ttype:str):
    "Make the rows of `ttype` of module `module_id` at `step` NaN (a NaN count, the mean unknown), and return that module's name."
    with engine(db).begin() as c:
        c.exec_driver_sql(f"UPDATE stats SET nan_count = 3, mean = NULL WHERE run_id = {int(run.id)} AND step = {step} "
                          f"AND module_id = {module_id} AND ttype = '{ttype}'")
        return c.exec_driver_sql(f"SELECT name FROM modules WHERE run_id = {int(run.id)} AND id = {module_id}").scalar()

def test_the_first_nan_is_exact_and_found_without_reading_the_unfolded_rows(gaps):
    "A NaN between the steps a sample reads, far into the unfolded steps: both searches name it, reading a few rows."
    from torchember.query import unfolded_steps, _sampled, VIEW_STEPS
    from torchember.diagnose import nonfinite_finding
    db, _, nan = gaps
    run = load('gaps', db)
    with engine(db).connect() as c: sampled = set(_sampled(unfolded_steps(c, run.id, 0), VIEW_STEPS))
    at = next(s for s in range(nan - 4001, 0, -1) if s not in sampled and s > FOLDED)   # where a sample does not look
    name = plant(db, run, at, 7, 'output')
    n, full = unfolded_rows(db, run)
    for sample in (False, True):
        with stats_reads(db) as seen: f = run.first_nonfinite(sample=sample)
        assert (f['step'], f['module'], f['ttype'], f['nan_count']) == (at, name, 'output', 3), (sample, f)
        assert seen[0] < full / 100, (sample, seen[0], full)
    assert run.first_nonfinite(after=at)['step'] == nan                     # the next one, as the explorer asks
    with stats_reads(db) as seen: got = nonfinite_finding(run, 0, STEPS)   # diagnose's NaN finding
    assert [(x['kind'], x['step'], x['module']) for x in got] == [('nonfinite', at, name)]
    assert seen[0] < full / 100, (seen[0], full)

def test_the_report_nan_table_is_exact_where_rollups_lack_bins_and_reads_a_few_rows(gaps):
    "Each tensor's first NaN step and count of steps, in the hole, after the folded steps and in them; a few rows read."
    from torchember.report import nonfinite
    db, _, nan = gaps
    run = load('gaps', db)
    planted = [(HOLE[0] + 953, 7, 'weight'), (HOLE[0] + 1201, 7, 'weight'), (FOLDED + 77, 9, 'output')]
    names = [plant(db, run, s, m, t) for s, m, t in planted]
    with engine(db).connect() as c:   # the truth, from every row
        want = c.exec_driver_sql(f"SELECT m.name, s.ttype, MIN(s.step), COUNT(DISTINCT s.step) FROM stats s JOIN modules m "
                                 f"ON m.run_id = s.run_id AND m.id = s.module_id WHERE s.run_id = {int(run.id)} AND s.ttype <> 'input' "
                                 f"AND (s.nan_count > 0 OR s.inf_count > 0) GROUP BY m.name, s.ttype").all()
    assert {(names[0], 'weight', HOLE[0] + 953, 2), (names[2], 'output', FOLDED + 77, 1)} <= {tuple(r) for r in want}
    n, full = unfolded_rows(db, run)
    with stats_reads(db) as seen: nf = nonfinite(run)
    got = set(map(tuple, nf[['module', 'ttype', 'first_step', 'steps']].values.tolist()))   # a row a tensor: weight, bias
    assert got == set(map(tuple, want)), (got, want)
    assert sorted(nf[nf['module'] == names[0]]['tname']) == ['bias', 'weight']
    assert seen[0] < full / 100, (seen[0], full)
    run.roll_up()   # folded, the same table, from the rollups
    assert set(map(tuple, nonfinite(run)[['module', 'ttype', 'first_step', 'steps']].values.tolist())) == set(map(tuple, want))

def test_an_older_store_gets_the_index_once_and_a_read_only_one_is_searched_as_before(tmp_path):
    "A store without the NaN/Inf index (an older torchember's) gains it when next opened, said once; read-only, exact all the same."
    import warnings
    from torchember import store as st
    from torchember.serve import use_read_only
    db = str(tmp_path/'old.db')
    build(db, modules=11, steps=600, record=20, name='old', folded=64)   # a NaN planted at step 400
    with engine(db).begin() as c: c.exec_driver_sql('DROP INDEX stats_nonfinite')
    def reopen():
        url = st.db_url(db)
        st._engines.pop(url).dispose(); st._opened.pop(url, None)
    reopen()
    want = 2 * 600 // 3
    ro = use_read_only(db)   # serve's: it cannot write, so no index; the rows are searched
    assert 'stats_nonfinite' not in {i['name'] for i in sa.inspect(ro).get_indexes('stats')}
    assert load('old', db).first_nonfinite()['step'] == want
    reopen()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        engine(db)
        reopen()
        engine(db)   # indexed now: nothing said
    assert [str(x.message) for x in w if 'indexing the NaN/Inf rows' in str(x.message)].__len__() == 1
    assert 'stats_nonfinite' in {i['name'] for i in sa.inspect(engine(db)).get_indexes('stats')}
    assert load('old', db).first_nonfinite()['step'] == want
