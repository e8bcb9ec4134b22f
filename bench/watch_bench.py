#!/usr/bin/env python
"""What the live detectors (`torchember.watch`) cost the writer, on `bench.py`'s models (issue 51).

Each model trains `--steps` recorded steps (every step recorded, `torch.set_num_threads(2)`, SGD) with a thread writer
(`TORCHEMBER_WRITER=thread`, so that the whole of the writer's work is on one thread of this process) or a process
writer. On the writer's thread, the CPU time of each `Writer._put` call (turning steps into rows and writing them, or
handing them to the writer process) and, within it, of `_watched` (the detectors, plus the `on_step` / `on_finding`
callbacks: none here but `--sink`) are summed with `time.thread_time`. Printed per model: writer CPU ms a step without
the watch, the watch's ms a step, and the watch's share of the rest. Also: what the `stop_on` pre-hook adds to a step
that nothing stopped (a forward pre-hook that reads one attribute), timed over a million calls.

    python bench/watch_bench.py [--models mlp32,resnet18,alexnet,gpt2] [--steps 60] [--writer thread|process] [--sink]
"""
import argparse, os, sys, tempfile, time, timeit
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
sys.path.insert(0, str(HERE.parent))
import torch
import corpus
from torchember import torchEmber
from torchember import ember as E
from torchember.store import Writer

def measure(name:str, steps:int, sink:bool)->dict:
    model, make_batch = corpus.BENCH[name]()
    model.train()
    args, kwargs = make_batch(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    spent = {'write': 0.0, 'watch': 0.0, 'steps': 0}
    write, watched = Writer._put, E.torchEmber._watched
    def timed_write(self, recs):
        t = time.thread_time()
        try: return write(self, recs)
        finally: spent['write'] += time.thread_time() - t; spent['steps'] += len(recs)
    def timed_watch(self, args):
        t = time.thread_time()
        try: return watched(self, args)
        finally: spent['watch'] += time.thread_time() - t
    Writer._put, E.torchEmber._watched = timed_write, timed_watch
    try:
        with tempfile.TemporaryDirectory() as d:
            te = torchEmber(model, run=name, db=f'{d}/w.db', stop_on=['nonfinite', 'spike'])
            if sink:
                from torchember.sinks import TensorBoardSink
                tb = TensorBoardSink(f'{d}/tb').attach(te)
            for _ in range(steps):
                out = model(*args, **kwargs)
                corpus.loss_of(out).backward(); opt.step(); opt.zero_grad()
            te.flush()
            rows = len(te.latest())
            te.disarm()
            if sink: tb.close()
    finally: Writer._put, E.torchEmber._watched = write, watched
    n = max(spent['steps'], 1)
    rest = spent['write'] - spent['watch']
    return dict(model=name, steps=spent['steps'], rows=rows, writer_ms=1e3 * rest / n,
                watch_ms=1e3 * spent['watch'] / n, share=spent['watch'] / rest if rest > 0 else float('nan'))

def hook_cost()->float:
    "Microseconds the `stop_on` pre-hook adds to a module call when nothing stopped (a call through torch's hook loop)."
    lin = torch.nn.Identity()
    x = torch.zeros(1)
    bare = min(timeit.repeat(lambda: lin(x), number=200_000, repeat=5))
    with tempfile.TemporaryDirectory() as d:
        te = torchEmber(torch.nn.Sequential(lin), db=f'{d}/h.db', stop_on='nonfinite', every=10**9)
        te.disarm()
        h = lin.register_forward_pre_hook(E._Hook(te._check_stop), prepend=True)
        hooked = min(timeit.repeat(lambda: lin(x), number=200_000, repeat=5))
        h.remove()
    return (hooked - bare) / 200_000 * 1e6

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--models', default='mlp32,resnet18,alexnet,gpt2')
    p.add_argument('--steps', type=int, default=60)
    p.add_argument('--writer', default='thread', choices=['thread', 'process'])
    p.add_argument('--sink', action='store_true', help='a TensorBoardSink attached too')
    a = p.parse_args()
    os.environ['TORCHEMBER_WRITER'] = a.writer
    torch.set_num_threads(2)
    print(f"writer: {a.writer}; sink: {'TensorBoard' if a.sink else 'none'}")
    print(f"{'model':10} {'steps':>5} {'rows':>6} {'writer ms':>10} {'watch ms':>9} {'share':>7}")
    for name in a.models.split(','):
        r = measure(name, a.steps, a.sink)
        print(f"{r['model']:10} {r['steps']:5d} {r['rows']:6d} {r['writer_ms']:10.3f} {r['watch_ms']:9.3f} "
              f"{r['share']:7.1%}")
    print(f"stop_on pre-hook on a step nothing stopped: {hook_cost():.2f} us")
