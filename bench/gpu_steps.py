#!/usr/bin/env python
"""Step by step host time of a model armed `every=10` against bare, on a GPU: recorded steps, the steps after them, the flush.

`bench/gpu.py` times whole blocks, so an `every=10` ratio mixes the recorded step, what it leaves for the steps after
it (the writer's work, GIL contention) and the flush that ends a block. This times each step on the host (no device
synchronize between steps, as in training: a step's time includes waiting for the launch queue) and splits them.
Armed runs alternate a writer process and a writer thread (`TORCHEMBER_WRITER`), each after a bare run.

    python bench/gpu_steps.py                                # GPT-2-small layout, 100 steps a run, 2 rounds
    python bench/gpu_steps.py --models resnet18-b256 --steps 60
    python bench/gpu_steps.py --device cpu --tiny            # a smoke test of the script
"""
import argparse, os, statistics, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / 'tests'), str(HERE.parent)]

import torch
import gpu
from torchember import torchEmber

def run(model, step, device, db, steps:int, writer:str|None)->tuple:
    "`(seconds of each step, whether each was recorded, seconds of the flush and synchronize)`; `writer` None: bare."
    te = None
    if writer:
        os.environ['TORCHEMBER_WRITER'] = writer
        te = torchEmber(model, db=db, every=10)
        step(); te.flush()      # a run's first recorded step (its data-flow graph; the writer process starts) before the clock
    gpu.sync(device)
    times, recorded = [], []
    for _ in range(steps):
        t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
        recorded.append(te is not None and te.capture.recording)
    t0 = time.perf_counter()
    if te is not None: te.flush()
    gpu.sync(device)
    tail = time.perf_counter() - t0
    if te is not None: te.disarm()
    os.environ.pop('TORCHEMBER_WRITER', None)
    return times, recorded, tail

def ms(xs)->str: return f"{statistics.median(xs) * 1e3:7.2f}" if xs else '    nan'

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--models', default='gpt2-small')
    p.add_argument('--steps', type=int, default=100)
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--tiny', action='store_true', help="small models: a smoke test of the script")
    a = p.parse_args(argv)
    device, name = gpu.device_named(a.device)
    print(f"device: {name}; torch {torch.__version__}; {os.cpu_count()} CPUs; ms a step, medians; sum and tail (flush) in ms")
    db = gpu.scratch_db('steps')
    for m, model, step in gpu.warmed(a.models, device, a.tiny):
        print(f"{m:<14} {'run':<8} {'recorded':>8} {'next':>7} {'2nd':>7} {'3rd':>7} {'others':>7} {'sum':>8} {'tail':>7}")
        for _ in range(a.rounds):
            for w in (None, 'process', 'thread'):
                ts, rec, tail = run(model, step, device, db, a.steps, w)
                after = [[t for i, t in enumerate(ts) if i >= k and rec[i - k] and not any(rec[i - k + 1:i + 1])] for k in (1, 2, 3)]
                others = [t for i, t in enumerate(ts) if not any(rec[max(0, i - 3):i + 1])]
                print(f"{m:<14} {w or 'bare':<8} {ms([t for t, r in zip(ts, rec) if r])} {ms(after[0])} {ms(after[1])} {ms(after[2])} "
                      f"{ms(others)} {sum(ts) * 1e3:8.0f} {tail * 1e3:7.1f}", flush=True)

if __name__ == '__main__':
    main()
