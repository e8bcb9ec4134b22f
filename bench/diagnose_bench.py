#!/usr/bin/env python
"""Time `Run.diagnose()` and `torchember.diff()` on a 10,000-step x 200-module SQLite store, written with `write_step`.

Three runs with 4 stat rows per module per step (input, output, weight, weight_grad: 8,000,000 rows each) and a
logged loss; 'b' equals 'a' bit for bit until step 9,500, where one module's output changes; 'c' is 'a' with the loss
and one module's output 10x at steps 9,000 and 9,980 (a spike for `diagnose` to trace).

    python bench/diagnose_bench.py [--db PATH] [--steps 10000] [--modules 200]   # builds the store if PATH lacks it
"""
import argparse, random, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torchember as te
from torchember.store import engine, create_run, write_step

def build(db, n_steps, n_mod, split):
    eng = engine(db)
    mods = [('', 'Sequential', None)] + [(str(i), 'Linear', 0) for i in range(n_mod - 1)]
    events = [('enter', 0, 0)] + [e for i in range(1, n_mod) for e in (('enter', i, 0), ('exit', i, 0))] + [('exit', 0, 0)]
    def rows(step, changed, spiky=False):
        r = random.Random(step)
        out = []
        for m in range(n_mod):
            for tt in ('input', 'output', 'weight', 'weight_grad'):
                v = 1.0 + 0.01 * r.random()
                if changed and m == 7 and tt == 'output': v += 1.0
                if spiky and m == 50 and tt == 'output': v *= 10
                out.append((m, 0, tt, 'weight' if tt.startswith('weight') else tt, '[32, 64]', 'float32',
                            2048.0, 0.1 * v, v, -v, v, 10 * v, 0.0, 0.0, 0.0, None, 8192))
        return out
    have = set(te.runs(db)['name'])
    for name in ('a', 'b', 'c'):
        if name in have: continue
        rid, _ = create_run(eng, name, 'Sequential', mods, {})
        t = time.perf_counter()
        for s in range(n_steps):
            spiky = name == 'c' and s in (n_steps - 1000, n_steps - 20)
            write_step(eng, rid, s, rows(s, name == 'b' and s >= split, spiky), events, events_step=None if s == 0 else 0,
                       scalars={'loss': (1.0 + 0.01 * random.Random(-s).random()) * (10 if spiky else 1)})
        print(f"wrote run {name!r}: {n_steps} steps x {n_mod} modules in {time.perf_counter() - t:.0f} s", flush=True)

def timed(f, reps=3):
    f(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--db', default=str(Path(tempfile.gettempdir())/'torchember-diagnose-bench.db'))
    p.add_argument('--steps', type=int, default=10_000)
    p.add_argument('--modules', type=int, default=200)
    a = p.parse_args()
    build(a.db, a.steps, a.modules, split=a.steps - 500)   # the runs the store lacks
    r, c = te.load('a', a.db), te.load('c', a.db)
    print(f"diagnose() of a clean run: {timed(lambda: r.diagnose()):.2f} s; found {len(r.diagnose())}")
    f = c.diagnose()
    print(f"diagnose() of a run with 2 spikes: {timed(lambda: c.diagnose()):.2f} s; found {len(f)}: {f['message'].head(3).tolist()}")
    print(f"diff(a, b): {timed(lambda: te.diff('a', 'b', db=a.db)):.2f} s; first: {te.diff('a', 'b', db=a.db).head(1).to_dict('records')}")
    print(f"diff(a, a): {timed(lambda: te.diff('a', 'a', db=a.db)):.2f} s")
    print(f"diff(a, b, rtol=0.5): {timed(lambda: te.diff('a', 'b', db=a.db, rtol=0.5)):.2f} s")
