"""`bench.py --compile`: an armed model under torch.compile against the same model compiled bare (CPU, inductor).

For each model and way of compiling (whole: `torch.compile(model)`; blocks: each block's `.compile(fullgraph=True)`;
and eager, not compiled, for the eager column of the same models on the same machine),
two fresh models of the same seed are compiled, one bare and one armed (`every=1`), and warmed up until compiled.
Printed: the graph breaks each compile took (dynamo's counters; `fullgraph=True` raises at a break), the graphs
compiled after the warm-up (recompiles: none should follow a change of `every` or a train/eval switch), and the time of
a training step, in blocks of K steps cycling bare, armed every step and armed `every=10` (the same compiled armed
model, its capture's `every` switched: the cadence is decided at run time, the graph is the same). Compiled, a third
model armed with `every=10, bare_unrecorded=True` runs blocks of its own (`lean10`): its unrecorded steps run a second,
hook-free graph, compiled once at its first unrecorded step, within its warm-up. Ratios are medians
of each round's armed/bare: of wall time, and (`cpu`) of the training thread's CPU time, which other work on a shared
machine moves less (torch on one thread runs there; a writer process's work is not in it).
"""
import statistics, tempfile, time
from pathlib import Path
import torch
from torch import nn
from torch._dynamo.utils import counters
import corpus

def gpt2():
    "GPT-2's layout, 6 blocks (the issue's), at the size two shared CPU cores train: 128 wide, 4 heads, 64 tokens of 4,096, batch 4."
    model, make = corpus.gpt_like(layers=6, d=128, seq=64)
    return model, make, lambda m: m.blocks

def mlp32():
    "32 x (Linear(64, 64), GELU), batch 32: the worst case of many tiny modules."
    model, make = corpus.mlp32()
    return model, make, None

def gpt2_regions():
    "`gpt2` with each block's forward a `torch.compiler.nested_compile_region`: one body compiled, stamped out 6 times."
    model, make, blocks = gpt2()
    for b in model.blocks: b.__class__ = _RegionBlock
    return model, make, blocks

class _RegionBlock(corpus.GPTBlock):
    forward = torch.compiler.nested_compile_region(corpus.GPTBlock.forward)

MODELS = {'gpt2': gpt2, 'mlp32': mlp32, 'gpt2_regions': gpt2_regions}

def _compile(model, how, blocks):
    if how == 'eager': return model
    if how == 'whole': return torch.compile(model)
    for b in blocks(model): b.compile(fullgraph=True)
    return model

def _stepper(call, model, make):
    "A training step of `model` through `call` (its compiled self, or it), and an eval call of it."
    args, kwargs = make(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step():
        corpus.loss_of(call(*args, **kwargs)).backward()
        opt.step(); opt.zero_grad()
    def evaluate():
        model.eval()
        with torch.no_grad(): call(*args, **kwargs)
        model.train()
    step.evaluate = evaluate
    return step

def _graphs(): return counters['stats']['unique_graphs']
def _breaks(): return sum(counters['graph_break'].values())

def _warm(step, n):
    g0, b0 = _graphs(), _breaks()
    for _ in range(n): step()
    return _graphs() - g0, _breaks() - b0

def _time(step, k):
    "Wall and thread CPU seconds a step, over `k` steps."
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(k): step()
    return (time.perf_counter() - t0) / k, (time.thread_time() - c0) / k

def bench(name, how, blocks_n, k, warm):
    "One model, one way of compiling: a dict of the figures."
    from torchember import torchEmber
    torch._dynamo.reset(); counters.clear()
    make_model = MODELS[name]
    armed_m, make, blocks = make_model()
    if how == 'blocks' and blocks is None: return None
    te = torchEmber(armed_m, run=f'compile-{name}-{how}', db=str(Path(tempfile.mkdtemp()) / 'compile.db'))   # armed first:
    # and armed with `bare_unrecorded=True`, before anything compiles (arming discards what was compiled before it)
    lean_m, _, _ = make_model() if how != 'eager' else (None, None, None)
    lean_te = None if lean_m is None else torchEmber(lean_m, run=f'compile-{name}-{how}-lean', every=10,
                                                     db=str(Path(tempfile.mkdtemp()) / 'lean.db'), bare_unrecorded=True)
    armed = _stepper(_compile(armed_m, how, blocks), armed_m, make)
    t0 = time.perf_counter()
    armed_graphs, armed_breaks = _warm(armed, warm)
    armed_s = time.perf_counter() - t0
    bare_m, _, _ = make_model()
    bare = _stepper(_compile(bare_m, how, blocks), bare_m, make)
    t0 = time.perf_counter()
    bare_graphs, bare_breaks = _warm(bare, warm)
    bare_s = time.perf_counter() - t0
    te.capture.every = 10
    _warm(armed, 10)                      # every=10 from here: no graph may follow
    steps = {'bare': bare, 'every1': armed, 'every10': armed}
    if lean_m is not None:               # its two graphs: a recorded step's, and the hook-free one of step 1
        steps['lean10'] = _stepper(_compile(lean_m, how, blocks), lean_m, make)
        _warm(steps['lean10'], 12)
    configs = list(steps)
    after = _graphs()
    times, cpu = {c: [] for c in configs}, {c: [] for c in configs}
    for r in range(blocks_n):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            te.capture.every = 1 if c == 'every1' else 10
            wall, used = _time(steps[c], k)
            times[c].append(wall); cpu[c].append(used)
    recompiles = _graphs() - after     # while every switched between 1 and 10
    g = _graphs(); bare.evaluate(); bare(); eval_bare = _graphs() - g       # a train/eval switch, and back
    g = _graphs(); armed.evaluate(); armed(); eval_armed = _graphs() - g
    te.flush(); rows = len(te.df()); te.disarm()
    if lean_te is not None: lean_te.flush(); lean_te.disarm()
    ratio = lambda c, t=times: statistics.median(a / b for a, b in zip(t[c], t['bare'])) if t.get(c) else float('nan')
    return dict(model=name, how=how, bare_ms=statistics.median(times['bare']) * 1e3,
                every1_ms=statistics.median(times['every1']) * 1e3, every10_ms=statistics.median(times['every10']) * 1e3,
                r1=ratio('every1'), r10=ratio('every10'), c1=ratio('every1', cpu), c10=ratio('every10', cpu),
                lean10=ratio('lean10'), clean10=ratio('lean10', cpu),
                breaks=armed_breaks - bare_breaks, graphs=(bare_graphs, armed_graphs),
                recompiles=recompiles, eval_graphs=(eval_bare, eval_armed), compile_s=(bare_s, armed_s), rows=rows)

def _x(ratio:float, width:int)->str:
    "A ratio printed `width` wide with its x, or a dash where there is none (an eager row has no `lean10`)."
    return f"{ratio:{width}.2f}x" if ratio == ratio else f"{'-':>{width}} "

def main(models, blocks_n=5, k=20, warm=3):
    print(__doc__.split('\n')[0])
    print(f"{blocks_n} rounds of {k} steps each; warm-up {warm} steps (the compile); ms are medians of a step")
    hdr = (f"{'model':<12} {'compile':<8} {'breaks+':>7} {'graphs b/a':>10} {'recompiles':>10} {'eval b/a':>8} {'bare ms':>8} {'every1 ms':>9} "
           f"{'ratio':>6} {'every10 ms':>10} {'ratio':>6} {'cpu ratios':>11} {'lean10':>6} {'cpu':>5} {'compile s b/a':>14}")
    print(hdr); print('-' * len(hdr))
    for name in models:
        for how in ('eager', 'whole', 'blocks'):   # eager: the same models uncompiled, armed over bare, beside
            r = bench(name, how, blocks_n, k, warm)
            if r is None:
                print(f"{name:<12} {how:<8} (no blocks: each of its modules is one torch's dynamo skips; compiled whole only)")
                continue
            print(f"{name:<12} {how:<8} {r['breaks']:7d} {r['graphs'][0]:>4}/{r['graphs'][1]:<5} {r['recompiles']:10d} "
                  f"{r['eval_graphs'][0]:>3}/{r['eval_graphs'][1]:<4} {r['bare_ms']:8.2f} {r['every1_ms']:9.2f} {r['r1']:5.2f}x {r['every10_ms']:10.2f} {r['r10']:5.2f}x {r['c1']:5.2f}/{r['c10']:4.2f}x {_x(r['lean10'], 5)} {_x(r['clean10'], 4)} "
                  f"{r['compile_s'][0]:6.1f}/{r['compile_s'][1]:<6.1f}", flush=True)
