#!/usr/bin/env python
"""Where an armed compiled step's time goes, phase by phase (issue 48): medians fine enough to see tens of µs.

One model (`bench.py --compile`'s gpt2 or mlp32) is compiled whole twice, bare and armed, and trained one step of each
in turn (which goes first alternates). Each step is timed in three phases: forward, backward, optimizer step.
Printed, beside the machine: the median of each phase, bare, and armed minus bare, on unrecorded steps (`every` a
billion) and on recorded ones (`every=1`); for the recorded ones, what torchember's own work inside them took a step
(the regions' `record_calls`, measuring the activations; the weights and grads read after the backward; the step's
close), the bytes a recorded step measures, and the rate that makes. A whole step's ratio moves by several percent
from run to run on a shared machine, and `compile_split.py`'s blocks cannot tell a change of 1-2% of a step; a
phase's median over a few hundred paired steps can. Nothing here asserts a figure.

`--bare-unrecorded` arms with `bare_unrecorded=True`: unrecorded steps then run a second graph, without the hooks.

    python bench/compile_parts.py [--model gpt2] [--threads 2] [--steps 200] [--bare-unrecorded]
"""
import argparse, statistics, sys, tempfile, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
import torch
import compile_bench as cb, corpus
from bench import machine_line

PHASES = ('forward', 'backward', 'optimizer')

def _phased(call, model, make):
    "A training step of `model` through `call` that appends its phases' seconds to the list it is given."
    args, kwargs = make(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step(into:list):
        t0 = time.perf_counter(); out = call(*args, **kwargs)
        t1 = time.perf_counter(); corpus.loss_of(out).backward()
        t2 = time.perf_counter(); opt.step(); opt.zero_grad()
        into.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return step

def _paired(armed, bare, n:int)->tuple:
    "`n` steps of each, in turn: each one's phases."
    a, b = [], []
    for i in range(n):
        for step, into in ((armed, a), (bare, b)) if i % 2 else ((bare, b), (armed, a)): step(into)
    return a, b

class _Timed:
    "Time the calls of `cls.name` (and count bytes with `size`) while in use."
    def __init__(self, cls, name, size=None):
        self.cls, self.name, self.size, self.s, self.bytes = cls, name, size, 0.0, 0
    def __enter__(self):
        self.orig = orig = getattr(self.cls, self.name)
        def timed(*a, **k):
            if self.size is not None: self.bytes += self.size(*a, **k)
            t0 = time.perf_counter()
            try: return orig(*a, **k)
            finally: self.s += time.perf_counter() - t0
        setattr(self.cls, self.name, timed)
        return self
    def __exit__(self, *exc): setattr(self.cls, self.name, self.orig)

def _region_bytes(hooks, tags, plan, ts)->int:
    "Bytes of the distinct tensors a region hands its op."
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in ts}.values())

def main(model:str='gpt2', threads:int=2, steps:int=200, bare_unrecorded:bool=False):
    from torchember import torchEmber
    from torchember.compiled import CompiledHooks
    from torchember.core import Capture
    from torchember.stats import Recorder
    print(__doc__.split('\n')[0]); print(machine_line())
    torch.set_num_threads(threads)
    m, make, blocks = cb.MODELS[model]()
    te = torchEmber(m, run='parts', db=str(Path(tempfile.mkdtemp()) / 'parts.db'),   # armed, then compiled
                    bare_unrecorded=bare_unrecorded)
    armed = _phased(cb._compile(m, 'whole', blocks), m, make)
    for _ in range(5): armed([])
    b, _, _ = cb.MODELS[model]()
    bare = _phased(cb._compile(b, 'whole', blocks), b, make)
    for _ in range(5): bare([])
    te.capture.every = 10**9
    for _ in range(3): armed([])
    un = _paired(armed, bare, steps)
    te.capture.every = 1
    for _ in range(3): armed([])
    te.flush()
    n = max(steps // 4, 10)
    with (_Timed(CompiledHooks, 'take_calls', _region_bytes) as regions, _Timed(Capture, '_grads_done') as grads,
          _Timed(Recorder, 'close') as close):
        rec = _paired(armed, bare, n)
    te.flush(); te.disarm()
    lean = ', bare_unrecorded' if bare_unrecorded else ''
    print(f"{model}, compiled whole{lean}, torch on {threads} thread(s); medians of {steps} unrecorded and {n} "
          f"recorded steps, each beside a bare one")
    for what, (a, b) in (('unrecorded', un), ('recorded', rec)):
        parts = []
        for i, phase in enumerate(PHASES):
            bare_us, armed_us = statistics.median(x[i] for x in b) * 1e6, statistics.median(x[i] for x in a) * 1e6
            parts.append(f"{phase} {bare_us:,.0f} us {armed_us - bare_us:+,.0f}")
        print(f"  {what:<10} bare, and armed over it: " + '; '.join(parts))
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    mb = (regions.bytes / n + 2 * params) / 1e6
    spent = (regions.s + grads.s) / n
    print(f"  a recorded step's own work: the regions' ops {regions.s / n * 1e3:.2f} ms "
          f"({regions.bytes / n / 1e6:.1f} MB of activations), weights and grads read after the backward "
          f"{grads.s / n * 1e3:.2f} ms ({2 * params / 1e6:.1f} MB), the step's close {close.s / n * 1e3:.2f} ms; "
          f"{mb:.1f} MB measured at {mb / 1e3 / spent:.1f} GB/s")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='gpt2', choices=list(cb.MODELS))
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--steps', type=int, default=200)
    p.add_argument('--bare-unrecorded', action='store_true')
    a = p.parse_args()
    main(a.model, a.threads, a.steps, a.bare_unrecorded)
