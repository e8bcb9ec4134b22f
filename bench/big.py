"""How quick a big run is to look at (issue 27): a wide model recorded for a few steps, copied forward in SQL to many.

    python bench/big.py [--modules 400] [--steps 5000 50000] [--record 50] [--db DIR_OR_URL] [--keep]

Builds, per `--steps` figure, a store holding one run of a model of `--modules` modules (Linear and GELU pairs in a
Sequential; with inputs, outputs, weights and grads about 4 rows a module a step): `--record` steps are recorded by
training, then copied forward in SQL (`INSERT ... SELECT` with the step shifted) until the run has `--steps` steps,
with a spike of one module's grad norm at one step and a NaN at another, so that what must stay visible is there.
Then it times, in CPU seconds of this process, what a user does: open the explorer on the run, redraw the heatmap for
another stat, click a module (its history), zoom the history and the map to 1,000 steps, `latest()`, `diagnose()`, and
the HTML report (with its size). It prints
the machine first. A benchmark, not a test: CI runs the same code paths on small stores.

    python bench/big.py --steps 50000 --gaps 2048 [--db DIR]

builds the store with its rollups folded for its first 2,048 steps only (a store whose rollups stop early: folded
by a writer that stopped folding, or by an older torchember), times opening the explorer, redrawing its heatmap and
a module's history on it, then `Run.roll_up()` (which folds the bins it lacks, 2,048 steps a transaction), a second
`roll_up()` (nothing left to fold), and the same views again, on the store now folded.
"""
import argparse, gc, importlib, os, statistics, sys, tempfile, time, warnings
from pathlib import Path
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench import machine_line

CHUNK = 8 * 2048   # steps folded into rollups at once: whole bins of the widest width, and a sort that fits the disk

def build(db:str, modules:int, steps:int, record:int, name:str='big', folded:int=None):
    "A store at `db` with run `name`: `record` steps trained, copied forward to `steps`; a spike and a NaN planted."
    from torchember import torchEmber
    from torchember.store import engine, roll_up, _sums_sql
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) if i % 2 == 0 else nn.GELU() for i in range(modules - 1)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    te = torchEmber(model, run=name, db=db, overwrite=True)
    for _ in range(record):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        te.log(loss=loss)
    te.disarm()
    eng = engine(db)
    with eng.begin() as c:
        rid = c.exec_driver_sql('SELECT id FROM runs WHERE name = ?' if eng.dialect.name == 'sqlite' else
                                'SELECT id FROM runs WHERE name = %(n)s', (name,) if eng.dialect.name == 'sqlite' else dict(n=name)).scalar()
        have = record
        while have < steps:
            k = min(have, steps - have)
            for table in ('stats', 'steps', 'digests', 'scalars', 'calls'):
                cols = [r[1] for r in c.exec_driver_sql(f'PRAGMA table_info({table})')] if eng.dialect.name == 'sqlite' else \
                       [r[0] for r in c.exec_driver_sql(f"SELECT column_name FROM information_schema.columns WHERE table_name = '{table}' ORDER BY ordinal_position")]
                sel = ', '.join(f'step + {have}' if col == 'step' else
                                f'iteration + {have}' if col == 'iteration' and table == 'steps' else
                                f'iteration_after + {have}' if col == 'iteration_after' else
                                f'events_step' if col == 'events_step' else f'"{col}"' for col in cols)
                c.exec_driver_sql(f'INSERT INTO {table} ({", ".join(chr(34) + x + chr(34) for x in cols)}) '
                                  f'SELECT {sel} FROM {table} WHERE run_id = {rid} AND step < {k}')
            have += k
        spike, nan = steps // 3, 2 * steps // 3
        c.exec_driver_sql(f"UPDATE stats SET norm = norm * 1000 WHERE run_id = {rid} AND step = {spike} AND ttype = 'weight_grad' AND module_id = 3")
        c.exec_driver_sql(f"UPDATE stats SET nan_count = 1, mean = NULL WHERE run_id = {rid} AND step = {nan} AND ttype = 'output' AND module_id = 5")
        c.exec_driver_sql(f'UPDATE runs SET last_step = {steps - 1} WHERE id = {rid}')
        c.exec_driver_sql(_sums_sql(rid, [spike, nan]))
        c.exec_driver_sql(f'DELETE FROM rollups WHERE run_id = {rid}')
    if eng.dialect.name == 'postgresql':   # what autovacuum does to tables that grew, before a user reads them
        with eng.connect().execution_options(isolation_level='AUTOCOMMIT') as c: c.exec_driver_sql('ANALYZE')
    t0 = time.perf_counter()
    for first in range(0, steps if folded is None else folded, CHUNK):   # what the writer would have folded; a chunk a transaction
        with eng.begin() as c: roll_up(c, rid, first=first, last=min(first + CHUNK, steps, folded or steps) - 1)
    print(f'  rollups folded in {time.perf_counter() - t0:.0f} s', flush=True)
    return spike, nan

def measure_gaps(db:str, name:str='big')->dict:
    "CPU seconds of what a user first does on a store whose rollups stop early: open the explorer, redraw, click."
    from torchember import explore
    out = {}
    ex, out['explore() opens'] = cpu(lambda: explore(db, run=name))
    ex.close()
    importlib.import_module('torchember.explore')._FINDINGS.clear()
    gc.collect()
    ex, out['explore() again'] = cpu(lambda: explore(db, run=name))
    _, out['heatmap redraws'] = cpu(lambda: setattr(ex.ov_stat, 'value', 'std' if ex.ov_stat.value != 'std' else 'max'))
    mod = ex.module_picker.options[len(ex.module_picker.options) // 2]
    _, out['module history'] = cpu(lambda: ex.select(mod[1] if isinstance(mod, tuple) else mod))
    ex.close()
    return out

def show(out:dict):
    for k, v in out.items(): print(f'  {k:18s} {v:8.2f}' + ('' if 'MiB' in k else ' s CPU'), flush=True)

def built(db:str, name:str):
    "`(spike, nan)` of run `name` if `db` holds it complete (a store kept from an earlier run of this script), else None."
    from torchember.store import engine
    if '://' not in db and not os.path.exists(db): return None
    with engine(db).connect() as c:
        try: rid, last = c.exec_driver_sql(f"SELECT id, last_step FROM runs WHERE name = '{name}'").one()
        except Exception: return None
        n = last + 1
        return (n // 3, 2 * n // 3) if c.exec_driver_sql(f'SELECT count(*) FROM rollups WHERE run_id = {rid}').scalar() else None

def cpu(fn):
    "`(result, CPU seconds of this process)` of `fn()`."
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0

def measure(db:str, name:str='big')->dict:
    from torchember import load, explore
    from torchember.report import report_html
    out = {}
    ex, out['explore() opens'] = cpu(lambda: explore(db, run=name))     # the first in the process: imports and plotly's first figures
    ex.close()
    kept = importlib.import_module('torchember.explore')._FINDINGS   # the findings of runs seen (not the function `explore`)
    def again(forget:bool):   # the median of three opens in this warm process, its garbage collected before each
        times = []
        for _ in range(3):
            if forget: kept.clear()
            gc.collect()
            e, t = cpu(lambda: explore(db, run=name))
            times.append(t); e.close()
        return statistics.median(times)
    out['explore() again'] = again(forget=True)          # diagnosing the run again
    out['... findings kept'] = again(forget=False)       # the run unchanged since the last open: its findings kept
    ex = explore(db, run=name)
    _, out['heatmap redraws'] = cpu(lambda: setattr(ex.ov_stat, 'value', 'std' if ex.ov_stat.value != 'std' else 'max'))
    mod = ex.module_picker.options[len(ex.module_picker.options) // 2]
    mod = mod[1] if isinstance(mod, tuple) else mod
    _, out['module history'] = cpu(lambda: ex.select(mod))
    mid = ex._steps[len(ex._steps) // 2]
    zoom = lambda ax, a, b: ex.fig.plotly_relayout({f'{ax}.range[0]': a, f'{ax}.range[1]': b}, source_view_id='bench')
    _, out['history zoom 1k'] = cpu(lambda: zoom('xaxis3', mid, mid + 999))   # drag over 1,000 steps: read again, every step
    _, out['map zoom 1k'] = cpu(lambda: zoom('xaxis', mid, mid + 999))
    ex.close()
    r = load(name, db)
    _, out['latest()'] = cpu(r.latest)
    _, out['diagnose()'] = cpu(r.diagnose)
    page, out['report'] = cpu(lambda: report_html(load(name, db)))
    out['report MiB'] = len(page.encode()) / 2**20
    return out

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--modules', type=int, default=400)
    p.add_argument('--steps', type=int, nargs='+', default=[5000, 50000])
    p.add_argument('--record', type=int, default=50)
    p.add_argument('--db', default=None, help='a folder for the SQLite files, or a PostgreSQL URL (one run per step count); '
                                              'a store built there before is reused')
    p.add_argument('--build-only', action='store_true', help='build the stores, measure nothing')
    p.add_argument('--gaps', type=int, default=None, help='fold the rollups of the first GAPS steps only; time the views, '
                                                          'then roll_up(), then the views again')
    a = p.parse_args()
    warnings.simplefilter('ignore')
    print(machine_line(), f'torch {torch.__version__}', flush=True)
    folder = a.db if a.db and '://' not in a.db else tempfile.mkdtemp()
    for n in a.steps:
        db = a.db if a.db and '://' in a.db else os.path.join(folder, f'big-{a.modules}x{n}{"-gaps" if a.gaps else ""}.db')
        t0 = time.perf_counter()
        spike, nan = built(db, f'big-{n}') or build(db, a.modules, n, a.record, name=f'big-{n}', folded=a.gaps)
        size = os.path.getsize(db) / 2**30 if '://' not in db else float('nan')
        print(f'{a.modules} modules x {n} steps: built in {time.perf_counter() - t0:.0f} s ({size:.2f} GiB); spike at step {spike}, NaN at {nan}', flush=True)
        if a.build_only: continue
        if a.gaps is None:
            show(measure(db, f'big-{n}'))
            continue
        from torchember import load
        run = load(f'big-{n}', db)
        print(f'  steps the rollups lack: {sum(b - a + 1 for a, b in run.unfolded())}', flush=True)
        show(measure_gaps(db, f'big-{n}'))
        for what in ('roll_up()', 'roll_up() again'):
            t0, c0 = time.perf_counter(), time.process_time()
            run.roll_up()
            print(f'  {what:18s} {time.process_time() - c0:8.2f} s CPU, {time.perf_counter() - t0:.1f} s wall', flush=True)
        print(f'  steps the rollups lack: {sum(b - a + 1 for a, b in run.unfolded())}; the views again:', flush=True)
        show(measure_gaps(db, f'big-{n}'))
