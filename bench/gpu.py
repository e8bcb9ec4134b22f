#!/usr/bin/env python
"""GPU benchmark for torchember: training steps armed vs bare on the accelerator, and host syncs per step.

Two models, as issue 18 asks: a GPT-2-small-sized decoder built from config (12 layers, 768 wide, 12 heads, sequence
512, batch 8, bf16 autocast, AdamW) and the ResNet-18 layout of `tests/corpus.py` at batch 256 (SGD). For each,
blocks of K steps alternate bare, armed every step and armed `every=10`, each block closed by `flush()` and a device
synchronize inside the clock (an armed block's first step, a run's first recorded step, which also captures the
model's data-flow graph once a run, is taken before the clock and its time printed apart); the table gives the
median ms a step, the ratio of medians and the median of paired ratios. Then it counts host syncs a step with
`torch.cuda.set_sync_debug_mode('warn')`: the syncs that torch's own ops make on the training thread (torchember's
copies to the host wait on the writer thread, which must not show up here), split into recorded and unrecorded
steps.

    python bench/gpu.py                       # on a CUDA machine
    python bench/gpu.py --device cpu --tiny   # a smoke test of the script itself, anywhere
    python bench/gpu.py --breakdown           # where a recorded step's time goes, part by part
    python bench/gpu.py --compile whole       # compiled (issue 48): `torch.compile(model)`, or `blocks`, each block's
                                              # `.compile(fullgraph=True)`; `--mode reduce-overhead` for CUDA graphs

Compiled, two copies of each model are built, one bare and one armed first (`every=1`), and compiled alike; the
armed one stays armed, its `every` switched between blocks (1, then 10: the graph is the same). Printed beside the
ratios: the graph breaks arming added, the graphs compiled after the warm-up (none should be), and the host syncs a
step, bare, recorded and unrecorded.
"""
import argparse, importlib.util, os, statistics, sys, tempfile, threading, time, warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
sys.path.insert(0, str(HERE.parent))

import torch
from torch import nn
import corpus
from torchember import torchEmber
from torchember.store.writer import use_process, cores


def gpt_setup(device, tiny, prepare=lambda m: m):
    "GPT-2-small's layout and its training step; the step calls `prepare(model)` (the model, armed or compiled)."
    torch.manual_seed(0)
    cfg = dict(layers=2, d=64, heads=4, vocab=1000, seq=32) if tiny else dict()
    model = corpus.GPTLike(**cfg).to(device)
    seq, batch = (32, 2) if tiny else (512, 8)
    vocab = model.head.out_features
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    call = prepare(model)
    def step():
        with amp: logits = call(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return model, step


def resnet_setup(device, tiny, prepare=lambda m: m):
    "The ResNet-18 layout and its training step; the step calls `prepare(model)`."
    model, make_batch = corpus.resnet_like(depth=18, tiny=tiny, batch=4 if tiny else 256)
    model = model.to(device)
    args, kwargs = make_batch(0)
    args = [a.to(device) for a in args]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    call = prepare(model)
    def step():
        corpus.loss_of(call(*args, **kwargs)).backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return model, step


MODELS = {'gpt2-small': gpt_setup, 'resnet18-b256': resnet_setup}


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def device_named(device:str)->tuple:
    "`(torch.device, its name)` for `--device`; exits where CUDA is asked for and there is none."
    dev = torch.device(device)
    if dev.type == 'cuda' and not torch.cuda.is_available(): sys.exit("no CUDA device here: run with --device cpu (--tiny) to check the script")
    return dev, torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'


def warmed(names:str, device, tiny:bool):
    "`(name, model, step)` for each of the comma-separated model `names`, three steps taken (kernels chosen, memory held)."
    for m in names.split(','):
        model, step = MODELS[m](device, tiny)
        for _ in range(3): step()
        yield m, model, step


def scratch_db(name:str)->str:
    "A path for store `name` in a new temporary folder."
    return str(Path(tempfile.mkdtemp(prefix=f'torchember-{name}-')) / f'{name}.db')


def block(model, step, k, device, every, db, first=None):
    "Seconds a step over `k` steps; armed with `every` (None: bare), the run's first step before the clock, flush inside."
    te = torchEmber(model, db=db, every=every) if every else None
    sync(device)
    if te is not None:   # a run's first recorded step captures its data-flow graph, and a writer process starts: once a run, timed apart
        t0 = time.perf_counter(); step(); te.flush(); sync(device)
        if first is not None: first.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(k): step()
    if te is not None: te.flush()
    sync(device)
    dt = (time.perf_counter() - t0) / k
    if te is not None: te.disarm()
    return dt


def _syncs(step)->int:
    "Host syncs torch reports on this thread during one `step` (its sync debug mode)."
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try: step()
        finally: torch.cuda.set_sync_debug_mode(0)
    return sum('synchroniz' in str(x.message) for x in w)


def syncs_per_step(model, step, device, db, steps=20, every=10):
    "The most host syncs in a bare step, a recorded step and an unrecorded one (`every` steps armed)."
    if device.type != 'cuda': return None
    bare = max(_syncs(step) for _ in range(3))
    te = torchEmber(model, db=db, every=every)
    step(); sync(device)                                # the first recorded step warms up
    counts = {True: [], False: []}
    for i in range(1, steps + 1): counts[i % every == 0].append(_syncs(step))
    te.disarm()
    return bare, max(counts[True]), max(counts[False])


def _cpu_bench():
    "bench/bench.py as a module: its switches that turn parts of an armed model off (`PARTS`)."
    spec = importlib.util.spec_from_file_location('cpu_bench', HERE / 'bench.py')
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def breakdown(m, model, step, device, db, blocks, k):
    "Where a recorded step's time goes: ms a step armed every step, each part switched off in turn (cumulatively)."
    cb = _cpu_bench()
    parts = cb.PARTS
    times = {label: [] for label, _, _ in [(None, None, None)] + parts}
    cpu, writer = {label: [] for label in times}, {label: [] for label in times}
    def block(i):
        label = parts[i - 1][0] if i else None
        before = set(threading.enumerate())
        te = torchEmber(model, db=db, every=1) if i else None
        for _, f, _ in parts[:i]:
            if f: f(te)
        if te is not None: step(); te.flush()   # a run's first recorded step before the clock, as in `block`
        sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(k): step()
        if te is not None: te.flush()
        sync(device)
        times[label].append((time.perf_counter() - t0) / k); cpu[label].append((time.thread_time() - c0) / k)
        writer[label].append(cb._writer_cpu([t for t in threading.enumerate() if t not in before and t.name == 'torchember-writer']) / k)
        if te is not None: te.disarm()
    for r in range(blocks):
        for i in (range(len(parts) + 1) if r % 2 == 0 else reversed(range(len(parts) + 1))): block(i)
    bare = statistics.median(times[None])
    med = lambda xs: statistics.median(xs) * 1e3
    print(f"{m}: where a step recorded every step goes ({blocks} blocks of {k} steps); bare {bare * 1e3:.2f} ms a step, "
          f"its training thread's CPU {med(cpu[None]):.2f} ms. Per variant: ms a step beyond bare, the training thread's "
          "CPU ms a step beyond bare's, the writer thread's CPU ms a step")
    prev = None
    for label, _, part in parts:
        ms = med(times[label]) - bare * 1e3
        print(f"  {label:<22} {ms:+8.2f} {med(cpu[label]) - med(cpu[None]):+8.2f} {med(writer[label]):8.2f}"
              + (f"   ({part}: {prev - ms:+.2f} ms)" if part else ""), flush=True)
        prev = ms


def compiler(how:str, mode):
    "What compiles a model `how`: whole (`torch.compile`) or `blocks` (each of `model.blocks`, `fullgraph=True`)."
    def compile_(model):
        if how == 'whole': return torch.compile(model, mode=mode)
        for b in model.blocks: b.compile(fullgraph=True, mode=mode)
        return model
    return compile_


def compiled_bench(m:str, device, tiny:bool, how:str, mode, blocks:int, k:int):
    "Model `m` compiled `how`, armed over bare: rows of the table, then graph breaks, recompiles and host syncs."
    from torch._dynamo.utils import counters
    if how == 'blocks' and m != 'gpt2-small':
        print(f"{m:<14} (compiled whole only: no `blocks`)"); return
    torch._dynamo.reset(); counters.clear()
    graphs, breaks = (lambda: counters['stats']['unique_graphs']), (lambda: sum(counters['graph_break'].values()))
    compile_, held = compiler(how, mode), {}
    def arm_then_compile(model):
        held['te'] = torchEmber(model, db=scratch_db('gpu-compiled'), every=1)
        return compile_(model)
    _, armed = MODELS[m](device, tiny, arm_then_compile)
    te, b0 = held['te'], breaks()
    for _ in range(3): armed()
    armed_breaks, b0 = breaks() - b0, breaks()
    _, bare = MODELS[m](device, tiny, compile_)
    for _ in range(3): bare()
    bare_breaks = breaks() - b0
    te.capture.every = 10
    for _ in range(10): armed()
    sync(device)
    g0, times = graphs(), {'bare': [], 1: [], 10: []}
    for r in range(blocks):
        for c in (['bare', 1, 10] if r % 2 == 0 else [10, 1, 'bare']):
            if c != 'bare': te.capture.every = c
            sync(device)
            t0 = time.perf_counter()
            for _ in range(k): (bare if c == 'bare' else armed)()
            if c != 'bare': te.flush()
            sync(device)
            times[c].append((time.perf_counter() - t0) / k)
    recompiles, base = graphs() - g0, statistics.median(times['bare'])
    label = f"{how}{'/' + mode if mode else ''}"
    for every in (1, 10):
        med = statistics.median(times[every])
        paired = statistics.median(x / y for x, y in zip(times[every], times['bare']))
        print(f"{m:<14} {label + ' every=' + str(every):<28} {base * 1e3:9.2f} {med * 1e3:9.2f} {med / base:6.2f}x {paired:6.2f}x", flush=True)
    print(f"{m:<14} graph breaks: armed {armed_breaks}, bare {bare_breaks}; graphs compiled after the warm-up: {recompiles}")
    if device.type == 'cuda':
        te.capture.every = 10
        counts = {True: [], False: []}
        for i in range(1, 21): counts[i % 10 == 0].append(_syncs(armed))
        print(f"{m:<14} host syncs a step (most seen): bare {max(_syncs(bare) for _ in range(3))}, "
              f"recorded {max(counts[True])}, unrecorded {max(counts[False])}")
    te.disarm()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--models', default=','.join(MODELS))
    p.add_argument('--blocks', type=int, default=7)
    p.add_argument('--steps', type=int, default=20, help="steps a block (a multiple of 10)")
    p.add_argument('--tiny', action='store_true', help="small models: a smoke test of the script")
    p.add_argument('--breakdown', action='store_true', help="only where a step recorded every step goes, part by part")
    p.add_argument('--compile', choices=['whole', 'blocks'], help="compiled armed over compiled bare (issue 48)")
    p.add_argument('--mode', default=None, help="torch.compile's mode with --compile: reduce-overhead, max-autotune")
    a = p.parse_args(argv)
    device, name = device_named(a.device)
    print(f"device: {name}; torch {torch.__version__}")
    db = scratch_db('gpu')
    by = use_process(db, torch.get_num_threads(), on_device=device.type != 'cpu')
    print(f"writer: {'a process' if by else 'a thread'} ({cores()} cores for this process, torch {torch.get_num_threads()} threads"
          f"{'; TORCHEMBER_WRITER=' + os.environ['TORCHEMBER_WRITER'] if os.environ.get('TORCHEMBER_WRITER') else ''})")
    if a.compile:
        print(f"{'model':<14} {'config':<28} {'bare ms':>9} {'armed ms':>9} {'ratio':>7} {'paired':>7}")
        for m in a.models.split(','): compiled_bench(m, device, a.tiny, a.compile, a.mode, a.blocks, a.steps)
        return
    if not a.breakdown: print(f"{'model':<14} {'config':<12} {'bare ms':>9} {'armed ms':>9} {'ratio':>7} {'paired':>7}")
    for m, model, step in warmed(a.models, device, a.tiny):
        if a.breakdown:
            breakdown(m, model, step, device, db, a.blocks, a.steps)
            continue
        times, first = {None: [], 1: [], 10: []}, []
        for r in range(a.blocks):
            for every in ((None, 1, 10) if r % 2 == 0 else (10, 1, None)):
                times[every].append(block(model, step, a.steps, device, every, db, first))
        bare = statistics.median(times[None])
        print(f"{m:<14} a run's first recorded step and its write (its data-flow graph captured, the writer process started where one writes; once a run, not in the blocks): "
              f"{statistics.median(first) * 1e3:.1f} ms", flush=True)
        for every in (1, 10):
            med = statistics.median(times[every])
            paired = statistics.median(x / y for x, y in zip(times[every], times[None]))
            print(f"{m:<14} {'every=' + str(every):<12} {bare * 1e3:9.2f} {med * 1e3:9.2f} {med / bare:6.2f}x {paired:6.2f}x", flush=True)
        s = syncs_per_step(model, step, device, db)
        if s is not None:
            print(f"{m:<14} host syncs a step (torch's sync debug mode, most seen): bare {s[0]}, recorded {s[1]}, unrecorded {s[2]}")


if __name__ == '__main__':
    main()
