#!/usr/bin/env python
"""Overhead benchmark for torchember: time one training step, bare vs armed, on three models.

A training step is forward + `loss_of` + backward + SGD step + zero_grad, with `torch.set_num_threads(2)`.
Models (from `tests/corpus.py`): ResNet-18 layout at 8x3x32x32, 32 x (Linear(64,64), GELU) at 32x64, AlexNet at 2x3x224x224.

Method: warm up, then time whole blocks of K steps, cycling bare and each armed configuration (bare, A1, A2, ...,
order reversed on every other round), N blocks each; report the median per-step time and the armed/bare ratio of
the medians, and beside it the median of each round's own armed/bare ratio (`paired`: blocks timed next to each other,
so a machine that slows down or speeds up between rounds moves both).
An armed block arms a fresh handle and takes the run's first step and writes it (it also captures the model's data-flow
graph, and a writer process starts: once a run; timed apart) before the clock starts, calls `handle.flush()` (if it has one) before the clock stops,
so deferred background work is counted, and disarms after. K is a multiple of 10 by default, so
`every=10` captures the same share of steps in every block. Then, unless `--no-store`, the store: stat rows/s
written through the store's write path, and `latest()` / one module's history on a 100-step vs a 10,000-step run.

    python bench/bench.py [--models resnet18,mlp32,alexnet] [--blocks N] [--steps K] [--quick] [--configs ember,ember10] [--no-store]
    python bench/bench.py --store
    python bench/bench.py --memory [--models mlp32] [--memory-steps 1000] [--configs ember]
    python bench/bench.py --breakdown [--models mlp32] [--every 10] [--cycles 40] [--blocks 6]

To add a configuration, append a `Config(label, arm_fn)` to what `configs()` returns (or register it in `CONFIGS`);
`arm_fn(model) -> handle`, and the handle needs a `disarm()` (or pass your own `disarm_fn`).
"""
import argparse, atexit, gc, itertools, os, platform, resource, shutil, statistics, sys, tempfile, threading, time, uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))   # for corpus
sys.path.insert(0, str(HERE.parent))             # torchember from this checkout, even if not installed

import torch
import corpus

try:
    from torchember import torchEmber
    _EMBER_ERR = None
except Exception as e:  # the library is being written; fall back to a dummy configuration
    torchEmber, _EMBER_ERR = None, e


# ---------------------------------------------------------------- configurations

def _default_disarm(handle):
    if hasattr(handle, 'disarm'): handle.disarm()

@dataclass
class Config:
    label: str
    arm: Callable[[torch.nn.Module], Any]            # model -> handle
    disarm: Callable[[Any], None] = _default_disarm   # handle -> None, called after the clock stops

_TMP, KEEP_DB = None, False
def scratch() -> Path:
    "Scratch folder for the configurations' databases, made on first use and removed at exit unless `KEEP_DB`."
    global _TMP
    if _TMP is None:
        _TMP = Path(tempfile.mkdtemp(prefix='torchember-bench-'))
        atexit.register(lambda: None if KEEP_DB else shutil.rmtree(_TMP, ignore_errors=True))
    return _TMP

_seq = itertools.count()
def _run_name(tag): return f"bench-{tag}-{os.getpid()}-{next(_seq)}-{uuid.uuid4().hex[:6]}"
def _db(tag): return str(scratch() / f"{tag}.db")

def ember(model): return torchEmber(model, run=_run_name('every1'), db=_db('every1'))
def ember10(model): return torchEmber(model, run=_run_name('every10'), db=_db('every10'), every=10)
def _instrument(tag, **opts):
    "A configuration with one opt-in instrument on top of the defaults."
    return lambda model: torchEmber(model, run=_run_name(tag), db=_db(tag), **opts)


class _DummyHandle:
    "Stand-in for a torchember handle: forward hooks on every module taking mean/std/absmax of float outputs."
    def __init__(self, model):
        self.stats = []
        self.hooks = [m.register_forward_hook(self._hook) for m in model.modules()]
    def _hook(self, mod, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                t = out.detach()
                self.stats.append(torch.stack([t.mean(), t.std(), t.abs().max()]))
    def flush(self):
        if self.stats: torch.stack(self.stats).tolist()
        self.stats.clear()
    def disarm(self):
        for h in self.hooks: h.remove()
        self.hooks = []

def dummy(model): return _DummyHandle(model)


CONFIGS = {
    'ember':   Config('torchEmber', ember),
    'ember10': Config('torchEmber every=10', ember10),
    'dummy':   Config('dummy hooks', dummy),
    # the cost of each opt-in instrument, on top of the defaults (`--configs ember,timing,io_grad,hist,updates,snapshot`)
    'timing':  Config('+ timing=True', _instrument('timing', timing=True)),
    'io_grad': Config('+ io_grad=True', _instrument('io_grad', io_grad=True)),
    'hist':    Config('+ hist=32', _instrument('hist', hist=32)),
    'hist_s':  Config('+ hist=32, sample_n=4096', _instrument('hist_s', hist=32, sample_n=4096)),
    'updates': Config('+ track_updates=True', _instrument('updates', track_updates=True)),
    'snapshot':Config("+ snapshot='*.output' (every output)", _instrument('snapshot', snapshot='*.output')),
}

def configs(names=None) -> list:
    "Configurations to run: `names` (keys of `CONFIGS`), else ember+ember10, or dummy if torchember isn't importable."
    if names is None:
        if torchEmber is None:
            print(f"note: `from torchember import torchEmber` failed ({type(_EMBER_ERR).__name__}: {_EMBER_ERR}); "
                  "running the dummy configuration (forward hooks computing mean/std/absmax) instead.\n")
            names = ['dummy']
        else: names = ['ember', 'ember10']
    out = []
    for n in names:
        if n not in CONFIGS: sys.exit(f"unknown config {n!r}; known: {', '.join(CONFIGS)}")
        if n.startswith('ember') and torchEmber is None: sys.exit(f"config {n!r} needs torchember: {_EMBER_ERR}")
        out.append(CONFIGS[n])
    return out


# ---------------------------------------------------------------- models & timing

MODELS = {  # name -> (factory, default steps per block, quick steps per block)
    'resnet18': (corpus.BENCH['resnet18'], 10, 10),
    'mlp32':    (corpus.BENCH['mlp32'], 100, 50),
    'alexnet':  (corpus.BENCH['alexnet'], 10, 10),
    'gpt2':     (corpus.BENCH['gpt2'], 10, 10),
}

def setup(name):
    model, make_batch = MODELS[name][0]()
    model.train()
    args, kwargs = make_batch(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step():
        out = model(*args, **kwargs)
        corpus.loss_of(out).backward()
        opt.step()
        opt.zero_grad()
    return model, step

@dataclass
class Block:
    "One timed block: seconds a step, CPU seconds of the training thread a step, and (armed) the writer's CPU (thread and process) and rows."
    wall: float
    cpu: float
    writer_cpu: float = 0.0
    writer_here: float = 0.0  # ... of it, on the writer thread of the training process (the child's holds none of its GIL)
    rows: int = 0            # stats rows the run holds
    timed_rows: int = 0      # ... of the steps taken, and written, in the clock
    first: float = 0.0       # seconds of the run's first step, taken before the clock

def _writer_cpu(threads) -> float:
    "CPU seconds the torchember writer threads among `threads` have used so far (0 where the OS cannot say)."
    total = 0.0
    for t in threads:
        try: total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (AttributeError, OSError, ProcessLookupError): pass
    return total

def _sink(handle):
    "The handle's `WriterProcess`, or None where a thread of this process writes (or for a stand-in handle)."
    return getattr(handle, 'writer_process', None)

def _process_cpu(handle) -> float:
    "CPU seconds the handle's writer process has used so far (0 where a thread writes, or where the OS cannot say)."
    proc = getattr(_sink(handle), 'proc', None)
    if proc is None: return 0.0
    try: fields = Path(f'/proc/{proc.pid}/stat').read_text().rsplit(')', 1)[1].split()
    except OSError: return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')   # utime + stime

def _rows(handle, after:int=-1) -> int:
    "Stats rows the handle's run holds of steps after `after` (0 for handles without a store)."
    eng, rid = getattr(handle, 'engine', None), getattr(handle, 'run_id', None)
    if eng is None or rid is None: return 0
    from sqlalchemy import text
    with eng.connect() as c:
        return c.execute(text('SELECT count(*) FROM stats WHERE run_id = :r AND step > :s'), dict(r=rid, s=after)).scalar()

def _step_of(handle) -> int:
    "The step a torchEmber handle is at (-1 for other handles)."
    cap = getattr(handle, 'capture', None)
    return cap.step if cap is not None else -1

def time_block(model, step, k, cfg: Optional[Config]) -> Block:
    """Per-step times of one block of `k` steps; armed if `cfg` (arm before / flush inside / disarm after the clock).
    A run's first step, which also captures the model's data-flow graph (once a run), is taken before the clock and timed apart."""
    gc.collect()
    before = set(threading.enumerate())
    handle = cfg.arm(model) if cfg else None
    first = 0.0
    if handle is not None and hasattr(handle, 'capture'):   # ... and written: a writer process has started by then
        t0 = time.perf_counter(); step(); handle.flush(); first = time.perf_counter() - t0
    first_step, p0 = _step_of(handle), _process_cpu(handle)
    w0 = _writer_cpu([t for t in threading.enumerate() if t not in before and t.name == 'torchember-writer'])
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(k): step()
    if handle is not None and hasattr(handle, 'flush'): handle.flush()
    dt, dc = time.perf_counter() - t0, time.thread_time() - c0
    out = Block(dt / k, dc / k, first=first)
    if handle is not None:
        writers = [t for t in threading.enumerate() if t not in before and t.name == 'torchember-writer']
        out.writer_here = _writer_cpu(writers) - w0
        out.writer_cpu = out.writer_here + _process_cpu(handle) - p0   # the thread's and its process's, in the clock
        out.rows, out.timed_rows = _rows(handle), _rows(handle, first_step)
        cfg.disarm(handle)
    return out

def warm_up(step, n, min_s):
    "At least `n` steps and at least `min_s` seconds: the first steps of a fresh model are often several times slower."
    t0, i = time.perf_counter(), 0
    while i < n or time.perf_counter() - t0 < min_s: step(); i += 1

def bench_model(name, cfgs, blocks, steps, warmup, warmup_s):
    model, step = setup(name)
    warm_up(step, warmup, warmup_s)
    for c in cfgs:  # one untimed armed block each, so first-use costs (imports, db creation) aren't timed
        time_block(model, step, 1, c)
    runs = {None: []} | {c.label: [] for c in cfgs}
    order = [None] + cfgs
    for r in range(blocks):
        for c in (order if r % 2 == 0 else order[::-1]):
            runs[c.label if c else None].append(time_block(model, step, steps, c))
    times = {k: [b.wall for b in v] for k, v in runs.items()}
    bare = statistics.median(times[None])
    floor = 1 + read_floor(model) / bare
    def per_tensor(label):   # of each block beside its round's bare one: (training-thread, writer, its in-process part) µs a recorded tensor
        pairs = [((a.cpu - b.cpu) * steps / a.timed_rows, a.writer_cpu / a.timed_rows, a.writer_here / a.timed_rows)
                 for a, b in zip(runs[label], runs[None]) if a.timed_rows]
        return tuple(statistics.median(x) * 1e6 for x in zip(*pairs)) if pairs else (float('nan'),) * 3
    return [(name, c.label, bare, statistics.median(times[c.label]), floor, statistics.median(times[c.label]) / bare,
             statistics.median(a / b for a, b in zip(times[c.label], times[None])),
             _spread(times[None]), _spread(times[c.label]), *per_tensor(c.label),
             statistics.median(b.timed_rows for b in runs[c.label]) / steps,
             statistics.median(b.first for b in runs[c.label])) for c in cfgs]

def _spread(xs): return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


# ---------------------------------------------------------------- breakdown

def _off(obj, *names):
    "Replace methods `names` of `obj` by ones that do nothing (refusing names it lacks: a renamed one would stay on)."
    for n in names:
        if not callable(getattr(obj, n, None)): raise AttributeError(f"{type(obj).__name__} has no method {n!r} to switch off")
        setattr(obj, n, lambda *a, **k: None)

def _no_writer(h): _off(h.recorder, 'emit')               # records dropped before they reach the writer thread
def _no_activations(h): _off(h.recorder, 'tensor', 'tensors')   # inputs and outputs not measured
def _no_params(h): _off(h.recorder, 'params')             # weights and grads not measured
def _empty_hooks(h):
    "Module hooks called, doing nothing (the hooks are built at arming: disarmed and armed again around the switch)."
    cap = h.capture
    cap.disarm()
    _off(cap, '_pre', '_post')
    cap._made = None
    cap.arm()

PARTS = [  # (variant, what it switches off on top of the variant before, the part the difference between them measures)
    ('armed', None, None),
    ('no writer', _no_writer, 'the writer thread (rows to SQLite)'),
    ('no activation stats', _no_activations, 'stats of inputs and outputs'),
    ('no weight/grad stats', _no_params, 'stats of weights and grads'),
    ('empty hooks', _empty_hooks, "the module hooks' own work (events, names)"),
]

def breakdown(name, every, rounds, cycles, warmup_s):
    "Where an armed step's time goes: steps timed one by one, each part switched off in turn (cumulatively), bare blocks between."
    model, step = setup(name)
    warm_up(step, 5, warmup_s)
    labels = [label for label, _, _ in PARTS]
    variants = [(label, [f for _, f, _ in PARTS[:i + 1] if f]) for i, label in enumerate(labels)]
    k = every * (cycles + 1)                   # the first cycle of a block is not counted: first-use costs
    times = {label: [[] for _ in range(every)] for label in [None] + labels}
    flushes = {label: [] for label in labels}
    def block(v):
        label, offs = v if v else (None, [])
        gc.collect()
        h = None
        if v:
            h = torchEmber(model, run=_run_name('parts'), db=_db('parts'), every=every)
            for f in offs: f(h)
        for i in range(k):
            t0 = time.perf_counter(); step(); dt = time.perf_counter() - t0
            if i >= every: times[label][i % every].append(dt)
        if h is not None:
            t0 = time.perf_counter(); h.flush(); flushes[label].append(time.perf_counter() - t0)
            h.disarm()
    order = [None] + variants
    block(order[1])                            # untimed: imports, the store's creation
    for r in range(rounds):
        for v in (order if r % 2 == 0 else order[::-1]): block(v)
    bare = [statistics.median(ts) for ts in times[None]]
    cols = ['recorded', 'next', 'others'][:min(every, 3)]
    def split(xs): return [xs[0], *xs[1:2], *([statistics.mean(xs[2:])] if every > 2 else [])]
    print(f"breakdown: {name}, every={every}: {rounds} blocks of {cycles} counted cycles each. Per variant, the ms a step takes "
          f"beyond a bare step at the same place in the cycle (median over the blocks' cycles): the recorded step"
          + (", the one after it" if every > 1 else "") + (", the mean of the others" if every > 2 else "")
          + "; then a whole cycle's extra time, the final flush spread over the cycles, and its ratio to a bare cycle\n")
    head = f"{'variant':<22}" + ''.join(f"{c:>10}" for c in cols) + f"{'cycle':>10} {'ratio':>7}"
    print(head); print('-' * len(head))
    print(f"{'bare (ms a step)':<22}" + ''.join(f"{x*1e3:10.2f}" for x in split(bare)) + f"{sum(bare)*1e3:10.2f}")
    near, cost = {}, {}
    for label in labels:
        extra = [statistics.median(ts) - b for ts, b in zip(times[label], bare)]
        flush = statistics.median(flushes[label]) / cycles
        near[label], cost[label] = sum(extra[:2]) + flush, sum(extra) + flush
        print(f"{label:<22}" + ''.join(f"{x*1e3:+10.2f}" for x in split(extra)) +
              f"{cost[label]*1e3:+10.2f} {(sum(bare) + cost[label]) / sum(bare):6.3f}x", flush=True)
    print(f"\nthe extra time of the recorded step{' and the next' if every > 1 else ''} with the flush's share, part by part "
          "(the difference between a variant and the next one down" + ("; the other steps' is left out" if every > 2 else "") + "):")
    for (_, _, part), before, nxt in zip(PARTS[1:], labels, labels[1:]):
        print(f"  {part:<76} {(near[before] - near[nxt])*1e3:+6.2f} ms")
    print(f"  {'what is left: hooks on and off and called empty, the step opened and closed':<76} {near[labels[-1]]*1e3:+6.2f} ms")


# ---------------------------------------------------------------- memory

def rss_mb():
    "(VmRSS, VmHWM) in MiB from /proc/self/status; falls back to ru_maxrss for both."
    try:
        d = dict(l.split(':', 1) for l in Path('/proc/self/status').read_text().splitlines() if ':' in l)
        return int(d['VmRSS'].split()[0]) / 1024, int(d['VmHWM'].split()[0]) / 1024
    except Exception:
        m = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return m, m

def memory(names, cfgs, n_steps):
    print(f"resident memory (MiB), armed for {n_steps} steps; RSS = VmRSS, peak = VmHWM (process-wide)")
    print(f"{'model':<10} {'config':<22} {'before':>8} {'@50':>8} {f'@{n_steps}':>8} {'growth':>8} {'flushed':>8} {'disarmed':>9} {'peak':>8}")
    for name in names:
        for cfg in cfgs:
            model, step = setup(name)
            warm_up(step, 3, 1.0)
            gc.collect()
            before = rss_mb()[0]
            h = cfg.arm(model)
            at50 = None
            for i in range(1, n_steps + 1):
                step()
                if i == 50: at50 = rss_mb()[0]
            at_end = rss_mb()[0]
            if hasattr(h, 'flush'): h.flush()
            flushed = rss_mb()[0]
            cfg.disarm(h); gc.collect()
            disarmed, peak = rss_mb()
            print(f"{name:<10} {cfg.label:<22} {before:8.1f} {at50 or float('nan'):8.1f} {at_end:8.1f} "
                  f"{at_end - (at50 or before):+8.1f} {flushed:8.1f} {disarmed:9.1f} {peak:8.1f}", flush=True)
            del model, step, h; gc.collect()


# ---------------------------------------------------------------- store

def store_bench(rows_per_step=258, small=100, large=10_000, reps=5):
    "Sustained stat rows/s through the writer path, and `latest` / one-module-history query times on a short vs a long run."
    from torchember.store import engine, create_run, write_step
    from torchember.query import load
    import random
    db = _db('store')
    eng = engine(db)
    n_mod = 65
    mods = [('', 'Sequential', None)] + [(str(i), 'Linear', 0) for i in range(n_mod - 1)]
    def rows_for(step):
        r = random.Random(step)
        return [(i % n_mod, 0, ('input', 'output', 'weight', 'weight_grad')[i % 4], 'output', '[32, 64]', 'float32',
                 2048.0, r.random(), r.random(), -1.0, 1.0, 10.0, 0.0, 0.0, 0.0, None, 8192) for i in range(rows_per_step)]
    events = [('enter', i, 0) for i in range(n_mod)] + [('exit', i, 0) for i in reversed(range(n_mod))]
    print(f"store: SQLite (WAL), {rows_per_step} stat rows per step, events written once and shared by later steps\n")
    out = {}
    for n_steps in (small, large):
        name = f"store-{n_steps}-{uuid.uuid4().hex[:6]}"
        rid, _ = create_run(eng, name, 'Sequential', mods, {})
        batch = [rows_for(s) for s in range(min(n_steps, 200))]
        t0 = time.perf_counter()
        for s in range(n_steps):
            write_step(eng, rid, s, batch[s % len(batch)], events, events_step=None if s == 0 else 0)
        dt = time.perf_counter() - t0
        r = load(name, db)
        def q(f):
            f(); ts = []
            for _ in range(reps):
                t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
            return statistics.median(ts)
        t_latest = q(lambda: r.latest())
        t_hist = q(lambda: r.df(module='7', ttype='output', steps=(n_steps - 100, n_steps - 1)))
        t_full = q(lambda: r.df(module='7', ttype='output'))
        out[n_steps] = (t_latest, t_hist, t_full)
        print(f"{n_steps:>6} steps: wrote {n_steps*rows_per_step:>9,} rows at {n_steps*rows_per_step/dt:>9,.0f} rows/s; "
              f"latest() {t_latest*1e3:6.1f} ms; module history, last 100 steps {t_hist*1e3:6.1f} ms; "
              f"whole history ({n_steps} steps) {t_full*1e3:7.1f} ms")
    (a1, b1, _), (a2, b2, _) = out[small], out[large]
    print(f"\nlong/short run: latest() {a2/a1:.2f}x, module history over the last 100 steps {b2/b1:.2f}x")


def sqlite_floor(steps=400, group=16) -> float:
    "CPU µs a stats row costs SQLite itself here: raw sqlite3 into the store's `stats` table, as the writer batches, nothing else."
    import sqlite3
    from torchember.store import engine, stats_t, STAT_COLS
    db = _db('floor')
    engine(db).dispose()                      # the store's own schema, then plain sqlite3 on the file
    con = sqlite3.connect(db, isolation_level=None)
    con.execute('PRAGMA synchronous=NORMAL')  # as the store sets it (WAL mode is kept in the file)
    n = 256                                   # rows a step: the writer's largest multi-row statement (store.ROWS_PER_INSERT)
    cols = len(stats_t.columns)
    sql = f"INSERT OR REPLACE INTO stats VALUES {', '.join(['(' + ','.join('?' * cols) + ')'] * n)}"
    some = dict(numel=2048.0, mean=0.1, std=0.9, min=-1.0, max=1.0, norm=10.0, zero_frac=0.0, nan_count=0.0, inf_count=0.0)
    row = (*(some.get(k, 1.0) for k in STAT_COLS), None, 8192)   # every declared stat, then extra and nbytes
    flats = [[x for i in range(n) for x in (1, s, 0, i % 65, i // 65, ('input', 'output', 'weight', 'weight_grad')[i % 4], 'output',
                                             '[32, 64]', 'float32', *row)] for s in range(steps)]
    c0 = time.thread_time()
    for s, flat in enumerate(flats):
        if s % group == 0: con.execute('BEGIN')
        con.execute(sql, flat)
        if s % group == group - 1 or s == steps - 1: con.execute('COMMIT')
    con.close()
    return (time.thread_time() - c0) / (steps * n) * 1e6


# ---------------------------------------------------------------- CLI

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', default=None, help=f"comma-separated, from {','.join(MODELS)} (default: all; --memory: mlp32)")
    p.add_argument('--blocks', type=int, default=None, help="timed blocks per configuration (default 9, --quick 3)")
    p.add_argument('--steps', type=int, default=None, help="steps per block (default per model: resnet18 10, mlp32 100, alexnet 10; --quick mlp32 50)")
    p.add_argument('--warmup', type=int, default=None, help="untimed bare steps first, and at least 3 s of them (1 s with --quick) (default 5, --quick 2)")
    p.add_argument('--quick', action='store_true', help="fewer blocks and steps: a smoke test")
    p.add_argument('--configs', default=None, help=f"comma-separated, from {','.join(CONFIGS)} (default: ember,ember10, or dummy without torchember)")
    p.add_argument('--breakdown', action='store_true', help="instead of the ratios: where an armed step's time goes, each part switched off in turn (default model mlp32)")
    p.add_argument('--every', type=int, default=10, help="--breakdown: record one step in this many (default 10)")
    p.add_argument('--cycles', type=int, default=None, help="--breakdown: counted cycles of --every steps per block (default 40, --quick 5)")
    p.add_argument('--memory', action='store_true', help="instead of timing: RSS after step 50 and after --memory-steps, armed")
    p.add_argument('--memory-steps', type=int, default=1000)
    p.add_argument('--store', action='store_true', help="only the store: write rate and query times on 100 vs 10,000 steps")
    p.add_argument('--no-store', action='store_true', help="time the models only (by default the store figures follow them)")
    p.add_argument('--ingest', action='store_true', help="instead: stat rows a second into SQLite and PostgreSQL, 1, 2 and 4 "
                   "writing processes, and the steps each stored of those it ran (see bench/ingest_bench.py)")
    p.add_argument('--compile', action='store_true', help="instead: armed under torch.compile against compiled bare, whole and per block "
                   "(models gpt2, mlp32, gpt2_regions; see bench/compile_bench.py)")
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--keep-db', action='store_true', help="keep the scratch databases (default: removed at exit)")
    a = p.parse_args(argv)

    global KEEP_DB
    KEEP_DB = a.keep_db
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # so tiny gradients late in a run can't slow a block down
    names = a.models.split(',') if a.models else (['mlp32'] if a.memory or a.breakdown else list(MODELS))
    for n in names:
        if n not in MODELS and not (a.compile and n == 'gpt2_regions'):
            sys.exit(f"unknown model {n!r}; known: {', '.join(MODELS)}")
    cfgs = configs(a.configs.split(',') if a.configs else None)
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, scratch dbs in {scratch()}"
          + (" (kept)" if KEEP_DB else " (removed at exit)"))
    _print_kernel()
    _print_writer()
    _check_load()

    if a.memory: return memory(names, cfgs, a.memory_steps)
    if a.compile:
        import compile_bench
        return compile_bench.main([n for n in (names if a.models else compile_bench.MODELS) if n in compile_bench.MODELS],
                                  a.blocks or (3 if a.quick else 5), a.steps or (10 if a.quick else 20))
    if a.ingest:
        import ingest_bench
        return ingest_bench.main(8 if not a.quick else 3)
    if a.store: return store_bench()
    if a.breakdown:
        if torchEmber is None: sys.exit(f"--breakdown needs torchember: {_EMBER_ERR}")
        for n in names:
            breakdown(n, a.every, a.blocks or (2 if a.quick else 6), a.cycles or (5 if a.quick else 40), 1.0 if a.quick else 3.0)
        return _check_load()

    blocks = a.blocks or (3 if a.quick else 9)
    warmup = a.warmup if a.warmup is not None else (2 if a.quick else 5)
    warmup_s = 1.0 if a.quick else 3.0
    print(f"{blocks} blocks per configuration, warmup >= {warmup} steps and >= {warmup_s:.0f} s; times are median ms/step "
          f"(spread = (max-min)/median over blocks);\n"
          f"floor = 1 + one read of the params and a grad-sized copy (torch.sum of each) over the bare step: no stats of them can cost less\n")
    print("per tensor: CPU µs of the training thread beyond bare (median over blocks, each against its round's bare block) "
          "and of the writer (its thread, and its process where one writes), per recorded tensor (stats row); GIL µs: the writer's part on its "
          "thread in the training process, all of it that can hold the training's GIL (at most: SQLite's own work lets go of it); "
          "rows: recorded tensors a step, on average;\n"
          "first ms: a run's first step and its write, before each armed block's clock (it also captures the model's data-flow "
          "graph, and a writer process starts: once a run)\n")
    hdr = (f"{'model':<10} {'config':<22} {'steps':>5} {'bare ms':>9} {'armed ms':>9} {'floor':>7} {'ratio':>7} {'paired':>7} "
           f"{'spread b/a':>12} {'µs/tensor':>9} {'writer µs':>9} {'GIL µs':>7} {'rows':>6} {'first ms':>9}")
    print(hdr); print('-' * len(hdr))
    t_all = time.perf_counter()
    for n in names:
        steps = a.steps or MODELS[n][2 if a.quick else 1]
        for (mn, label, bare, armed, floor, ratio, paired, sb, sa, us, wus, gil, rows, first) in bench_model(n, cfgs, blocks, steps, warmup, warmup_s):
            print(f"{mn:<10} {label:<22} {steps:5d} {bare*1e3:9.2f} {armed*1e3:9.2f} {floor:6.2f}x {ratio:7.2f}x {paired:6.2f}x "
                  f"{sb*100:5.0f}%/{sa*100:3.0f}% {us:9.2f} {wus:9.2f} {gil:7.2f} {rows:6.0f} {first*1e3:9.1f}", flush=True)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    if torchEmber is not None:
        print(f"SQLite's own floor here: {sqlite_floor():.2f} µs of CPU a stats row (raw sqlite3 into the store's `stats` table, "
              "256-row statements, 16 steps a transaction, nothing else: no rollups, digests or SQLAlchemy)")
    _check_load()
    if not a.no_store and torchEmber is not None:
        print()
        store_bench()
        _check_load()

def _print_writer():
    "Say whether a process or a thread of the training process writes the store (`torchember.store.writer.use_process`)."
    if torchEmber is None: return
    from torchember.store.writer import use_process, cores
    by = use_process(str(scratch()/'choice.db'), torch.get_num_threads())
    print(f"writer: {'a process' if by else 'a thread'} ({cores()} cores for this process, torch {torch.get_num_threads()} threads"
          f"{'; TORCHEMBER_WRITER=' + os.environ['TORCHEMBER_WRITER'] if os.environ.get('TORCHEMBER_WRITER') else ''})")

def machine() -> dict:
    "What the figures depend on: CPU model, vendor, vector extensions, cores, cache sizes (from /proc and /sys on Linux)."
    info = dict(cpu=platform.processor() or platform.machine(), vendor='', vector=[], cores=os.cpu_count(), caches={})
    try: text = Path('/proc/cpuinfo').read_text()
    except OSError: text = ''
    fields = {}
    for line in text.splitlines():
        k, _, v = line.partition(':')
        fields.setdefault(k.strip(), v.strip())
    info['cpu'] = fields.get('model name') or fields.get('Model') or fields.get('CPU part') or info['cpu']
    info['vendor'] = fields.get('vendor_id') or fields.get('CPU implementer', '')
    flags = set((fields.get('flags') or fields.get('Features') or '').split())
    info['vector'] = [n for f, n in (('avx2', 'AVX2'), ('avx512f', 'AVX-512'), ('avx512_bf16', 'AVX512-BF16'),
                                     ('asimd', 'NEON'), ('sve', 'SVE')) if f in flags]
    try: info['cores'] = len(os.sched_getaffinity(0))
    except AttributeError: pass
    for d in sorted(Path('/sys/devices/system/cpu/cpu0/cache').glob('index*')):
        try: level, kind, size = ((d/f).read_text().strip() for f in ('level', 'type', 'size'))
        except OSError: continue
        if kind != 'Instruction': info['caches'][f"L{level}"] = size
    return info

def machine_line(m: dict = None) -> str:
    "One line naming the machine, printed beside every figure."
    m = m or machine()
    caches = ', '.join(f"{k} {v}" for k, v in m['caches'].items()) or 'caches unknown'
    return (f"machine: {m['cpu']} ({m['vendor'] or 'vendor unknown'}), {'/'.join(m['vector']) or 'no AVX2/AVX-512/NEON'}, "
            f"{m['cores']} cores, {caches}")

def read_floor(model, reps: int = 5) -> float:
    "Seconds for one read of `model`'s params and grads (a `torch.sum` of each; grads stood in by copies of the params, their size): what any stats of them must pay at least."
    ps = [p.detach() for p in model.parameters()]
    ts = ps + [p.clone() for p in ps]
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            for t in ts: t.sum()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)

def _print_kernel():
    "Say which kernel computes the moments of CPU tensors: the figures depend on it."
    try: from torchember import native
    except ImportError: return
    lib = native.library()
    threads = "torch's OpenMP workers" if lib and lib.openmp else "threads started per call"
    print("moments of CPU float tensors: " + (f"native C++ kernel (torchember.native), on {threads}" if lib else
          "torch.compile'd or eager kernels (native kernel off or not built)"))
    if lib:
        m, now = native.large_choice(), native.measure_large()
        print(f"large tensors (>= {native.LARGE:,} elements): {'native kernel' if native.large_native() else 'torch kernels'}, "
              f"the faster when first measured on this machine ({m['native']:.2f} against {m['torch']:.2f} ms); now, 4M float32 "
              f"elements: {now['native']:.2f} ms native, {now['torch']:.2f} ms torch, one torch.sum {now['sum']:.2f} ms "
              f"({now['native'] / now['sum']:.2f}x one read)")

def _check_load():
    "Warn when other processes compete for the CPUs: timings taken then are not worth much."
    try: load, ncpu = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError): return
    if load > ncpu + 0.5 or load > torch.get_num_threads() + 1.5:
        print(f"warning: 1-minute load average {load:.1f} on {ncpu} CPUs: something else is running; timings may be noisy")


if __name__ == '__main__':
    main()
