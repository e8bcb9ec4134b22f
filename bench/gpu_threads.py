#!/usr/bin/env python
"""Where an armed GPU step's time goes, thread by thread: wall ms a step and CPU ms a step of the training thread,
autograd's device thread (a CUDA backward runs there, and so do grad hooks) and torchember's writer (its thread, and
its process where one writes: `torchember.store.writer`), with parts of
torchember switched off in turn; then the GPU time of the stats kernels beside the step's, from torch's profiler.

On a GPU the stats run on the device, but every part of torchember that runs on the host runs on one of these threads,
and where the bare step keeps its host threads as busy as its device (a GPT-2-small step on an H100 does), what they
add is what the step loses. CPU times are read from /proc (the kernel's ticks, 10 ms apart: read them over whole
blocks), so this runs on Linux.

    python bench/gpu_threads.py                         # both models of bench/gpu.py
    python bench/gpu_threads.py --models gpt2-small --rounds 5 --profile --parts
"""
import argparse, cProfile, io, os, pstats, statistics, sys, threading, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / 'tests'), str(HERE.parent)]

import torch
import gpu, bench
from torchember import torchEmber, core, stats
from torchember.store import Writer

HZ = os.sysconf('SC_CLK_TCK')

def thread_cpu()->dict:
    "`tid -> (name, CPU seconds)` of this process's threads, from /proc."
    out = {}
    for tid in os.listdir('/proc/self/task'):
        try: s = open(f'/proc/self/task/{tid}/stat').read()
        except OSError: continue       # a thread that ended meanwhile
        f = s[s.rindex(')') + 2:].split()
        out[int(tid)] = (s[s.index('(') + 1:s.rindex(')')], (int(f[11]) + int(f[12])) / HZ)
    return out

def _no_param_hooks(te):
    "No parameter hooks (weights and grads unrecorded): the hooks are put on at arming, so disarmed and armed again."
    cap = te.capture
    cap.disarm()
    cap.current_params, cap.params, cap._made = (lambda: []), [], None
    cap.arm()
def _writer_at_flush(te): w = te._start_writer(); w.linger, w.group = 1e9, 10**9

VARIANTS = {  # name -> switches applied to a fresh torchEmber (None: bare)
    'bare': None,
    'armed': [],
    'writer only at flush': [_writer_at_flush],
    'no writer': [bench._no_writer],
    'no writer, no param hooks': [bench._no_writer, _no_param_hooks],
    'nothing but module hooks': [bench._no_writer, _no_param_hooks, bench._no_activations, bench._empty_hooks],
}

def block(model, step, k, device, db, fs):
    "`(seconds a step, {thread: CPU seconds a step})` of `k` steps, armed with switches `fs` (None: bare), flush inside."
    te = torchEmber(model, db=db, every=1) if fs is not None else None
    for f in fs or []: f(te)
    if te is not None: step(); te.flush()   # a run's first recorded step (its data-flow graph; a writer process starts) before the clock
    if (sink := bench._sink(te)) is not None: sink(te.run_id, te.rank, [])   # booted before the clock, though no step reach it
    gpu.sync(device)
    a, p0, t0 = thread_cpu(), bench._process_cpu(te), time.perf_counter()
    for _ in range(k): step()
    if te is not None: te.flush()
    gpu.sync(device)
    dt, b = (time.perf_counter() - t0) / k, thread_cpu()
    writer = te.writer._t.native_id if te is not None and te.writer is not None else None
    cpu = dict(training=0., autograd=0., writer=0., other=0., process=(bench._process_cpu(te) - p0) / k)   # process: the writer's
    for tid, (name, c) in b.items():
        part = ('training' if tid == os.getpid() else 'writer' if tid == writer else
                'autograd' if name.startswith('pt_autograd') else 'other')
        cpu[part] += (c - a.get(tid, (name, 0.))[1]) / k
    if te is not None: te.disarm()
    return dt, cpu

PARTS = [(core.Capture, ('_pre', '_post', '_root_pre', '_grad_hook', '_grads_done', 'close')),
         (stats.Recorder, ('tensor', '_planned', '_read_later', '_gather')), (Writer, ('_put',))]

def parts_cpu(model, step, device, db, k:int)->dict:
    "`{(thread, method): CPU seconds a step}` of torchember's main methods over `k` recorded steps (nested calls overlap)."
    acc, orig, training = {}, [], os.getpid()
    def timed(cls, name, f):
        def w(*a, **kw):
            c0 = time.thread_time()
            try: return f(*a, **kw)
            finally:
                tid = threading.get_native_id()
                key = ('training' if tid == training else 'writer' if threading.current_thread().name == 'torchember-writer'
                       else 'autograd', f"{cls.__name__}.{name}")
                acc[key] = acc.get(key, 0.) + time.thread_time() - c0
        return w
    for cls, names in PARTS:
        for n in names: orig.append((cls, n, getattr(cls, n))); setattr(cls, n, timed(cls, n, getattr(cls, n)))
    try:
        te = torchEmber(model, db=db, every=1)
        step()
        acc.clear()
        for _ in range(k): step()
        te.flush(); gpu.sync(device); te.disarm()
    finally:
        for cls, n, f in orig: setattr(cls, n, f)
    return {key: v / k for key, v in acc.items()}

def kernel_ms(step, device, steps=3)->tuple:
    "GPU ms a step of all kernels and of torchember's stats kernels (Triton's `_many`, `_one`, `_finish`), by torch's profiler."
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(steps): step()
        gpu.sync(device)
    ev = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = sum(e.self_device_time_total for e in ev if e.key in ('_many', '_one', '_finish'))
    return sum(e.self_device_time_total for e in ev) / steps / 1e3, ours / steps / 1e3

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--models', default=','.join(gpu.MODELS))
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--tiny', action='store_true', help="small models: a smoke test of the script")
    p.add_argument('--profile', action='store_true', help="also cProfile the training thread over 10 recorded steps")
    p.add_argument('--parts', action='store_true', help="also CPU ms a step of torchember's main methods, by the thread they ran on")
    a = p.parse_args(argv)
    device, name = gpu.device_named(a.device)
    print(f"device: {name}; torch {torch.__version__}; {os.cpu_count()} CPUs")
    db = gpu.scratch_db('threads')
    for m, model, step in gpu.warmed(a.models, device, a.tiny):
        te = torchEmber(model, db=db, every=1)
        for _ in range(3): step()      # the stats kernels compile
        te.flush(); te.disarm()
        res = {v: [] for v in VARIANTS}
        for r in range(a.rounds):
            for v in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]): res[v].append(block(model, step, a.steps, device, db, VARIANTS[v]))
        print(f"\n{m}: ms a step (median of {a.rounds} blocks of {a.steps}), and CPU ms a step by thread")
        for v, xs in res.items():
            cpu = {k: statistics.median(c[k] for _, c in xs) * 1e3 for k in xs[0][1]}
            print(f"  {v:<27} {statistics.median(t for t, _ in xs) * 1e3:8.2f}   " + '  '.join(f"{k} {x:6.2f}" for k, x in cpu.items()), flush=True)
        if a.parts:
            print("  CPU ms a step of torchember's methods, by thread (a method's time includes the methods it calls):")
            for (thread, meth), v in sorted(parts_cpu(model, step, device, db, a.steps).items(), key=lambda x: -x[1]):
                print(f"    {thread:<9} {meth:<26} {v * 1e3:7.2f}")
        te = torchEmber(model, db=db, every=1)
        step(); gpu.sync(device)
        if a.profile:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(10): step()
            pr.disable()
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(20); print(s.getvalue())
        if device.type == 'cuda':
            tot, ours = kernel_ms(step, device)
            print(f"  GPU kernel time a recorded step (torch's profiler): {tot:.2f} ms, of which torchember's stats kernels {ours:.2f} ms")
        te.flush(); te.disarm()
        del model, step

if __name__ == '__main__':
    main()
