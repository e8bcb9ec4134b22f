#!/usr/bin/env python
"""The host side of torchember's GPU path, timed on a CPU: the Triton launches stubbed out and CPU tensors routed to them.

On a GPU an armed step costs host time (`bench/gpu_threads.py`): the hooks' Python, the batching and launching of the
stats kernels, the weights' and grads' plans. None of that needs a GPU to run, so this script runs it on CPU tensors
of a small GPT-2 layout (tiny tensors, so that Python, as on a GPU's host, is most of a step) with the native CPU
kernel off, the CPU counted as one of Triton's devices and the kernels replaced by launches that do nothing. It
prints the training thread's CPU a step, bare and armed, then the CPU of torchember's main methods. The stats it
stores are garbage; only its times mean anything, and only beside each other in one run.

    python bench/gpu_proxy.py
    python bench/gpu_proxy.py --layers 24 --rounds 9
"""
import argparse, os, statistics, sys, tempfile, time, warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / 'tests'), str(HERE.parent)]

import torch
import corpus, gpu_threads
from torchember import torchEmber, stats, native, triton_moments

class _Launch:
    "A Triton kernel whose launches do nothing."
    def __getitem__(self, grid): return lambda *args, **kwargs: None

def stub_gpu_path():
    "Send CPU float tensors down the GPU path, to kernels that are never run."
    triton_moments._many = triton_moments._one = triton_moments._finish = _Launch()
    stats.TRITON_DEVICES.add('cpu')
    native.library = lambda: None

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--layers', type=int, default=12)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--steps', type=int, default=30)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    stub_gpu_path()
    warnings.filterwarnings("ignore", category=RuntimeWarning)   # the garbage stats overflow
    model, make_batch = corpus.gpt_like(layers=a.layers, d=64, heads=4, vocab=256, seq=16, batch=2)
    (ids,), _ = make_batch(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step(): corpus.loss_of(model(ids)).backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(5): step()
    db = str(Path(tempfile.mkdtemp(prefix='torchember-proxy-')) / 'proxy.db')
    def block(armed:bool)->float:
        te = torchEmber(model, db=db, every=1) if armed else None
        if te is not None: step()      # a run's first recorded step (its data-flow graph) before the clock
        c0 = time.thread_time()
        for _ in range(a.steps): step()
        c = (time.thread_time() - c0) / a.steps
        if te is not None: te.flush(); te.disarm()
        return c
    cpu = {False: [], True: []}
    for r in range(a.rounds):
        for armed in ((False, True) if r % 2 == 0 else (True, False)): cpu[armed].append(block(armed))
    bare, armed = statistics.median(cpu[False]), statistics.median(cpu[True])
    print(f"GPT-2 layout, {a.layers} layers 64 wide, CPU with the GPU path stubbed; torch {torch.__version__}, 1 thread")
    print(f"training thread's CPU a step: bare {bare * 1e3:.2f} ms, armed +{(armed - bare) * 1e3:.2f} ms "
          f"(median of {a.rounds} blocks of {a.steps} steps)")
    print("CPU ms a step of torchember's methods, by thread (a method's time includes the methods it calls):")
    for (thread, meth), v in sorted(gpu_threads.parts_cpu(model, step, torch.device('cpu'), db, a.steps).items(), key=lambda x: -x[1]):
        print(f"  {thread:<9} {meth:<26} {v * 1e3:7.2f}")

if __name__ == '__main__':
    main()
