#!/usr/bin/env python
"""Moments taken inside the compiled graph, by inductor's own code, against torchember's native kernel (issue 48).

torchtitan's tensor logging computes its stats inside the graph, where the tensors are made. On a CPU, would inductor's
code for torchember's 8 moments (n, sum, sum of squares, min, max, nonzeros, NaNs, Infs) beat the native kernel that
the regions' ops call now, given that it reads each activation right after the kernel that wrote it, still in cache?

Two parts, each printed beside the machine:
- **kernels**: float32 tensors of each size, their moments by a `torch.compile`d function of torch ops (`moments8`:
  sums in float64, as eager's; `moments5`: five moments with sums in float32, the least the stats need; `welford`:
  all 8 from float32 reductions, the sum of squares from a Welford mean and variance, stable where float32 sums of
  squares are not) and by the native kernel (`torchember.native.moments`), median µs a tensor, and GB/s;
- **models** (`bench.py --compile`'s GPT-2 layout and 32-layer MLP, compiled whole): the forward of a recorded step over the bare
  compiled forward, for torchember armed (`every=1`) and for hooks that compute the moments in the graph (each of the
  three ways) and hand the stacked result to one op a step. Each variant runs beside its own bare model, in a process of
  its own, with dynamo's guards on module hooks on (as arming sets them): without them the hooked model ran the bare
  model's graph, and a first version of this script found the in-graph moments free.
Nothing here asserts a figure.

    python bench/ingraph_moments.py [--models gpt2,mlp32] [--steps 150] [--threads 2] [--quick]
"""
import argparse, json, statistics, subprocess, sys, tempfile, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
import torch
from bench import machine_line

F64 = torch.float64
VARIANTS = ('ember', 'graph8', 'graph5', 'welford')   # armed; in-graph: 8 moments, 5, and 8 from a Welford pass

def moments8(x):
    "The 8 moments of `x` in torch ops, sums in float64: eager's numbers, for inductor to compile."
    x = x.detach().reshape(-1)
    d = x.to(F64)
    z = d.new_zeros(())
    return torch.stack([z + x.shape[0], d.sum(), (d*d).sum(), x.amin().to(F64), x.amax().to(F64),
                        (x != 0).sum().to(F64), x.isnan().sum().to(F64), x.isinf().sum().to(F64)])

def moments5(x):
    "Sum, sum of squares, min, max and nonzeros of `x`, sums in float32: the least in-graph work the stats need."
    x = x.detach().reshape(-1)
    return torch.stack([x.sum(), (x*x).sum(), x.amin(), x.amax(), (x != 0).sum().to(x.dtype)])

def moments_welford(x):
    "The 8 moments of `x` from float32 reductions, the sum of squares from mean and variance (Welford's, stable)."
    x = x.detach().reshape(-1)
    var, mean = torch.var_mean(x, correction=0)
    n = x.new_zeros((), dtype=F64) + x.shape[0]
    m, v = mean.to(F64), var.to(F64)
    return torch.stack([n, m * n, (v + m * m) * n, x.amin().to(F64), x.amax().to(F64), (x != 0).sum().to(F64),
                        x.isnan().sum().to(F64), x.isinf().sum().to(F64)])

WAYS = {'moments8': moments8, 'moments5': moments5, 'welford': moments_welford}

def _median_us(f, x, n:int)->float:
    "Median µs of `f(x)` over `n` calls, after two."
    f(x); f(x)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(x); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6

def kernels(sizes, n:int, k:int=16):
    "Print the µs and GB/s of each way of measuring a float32 tensor of each size, `k` tensors a call."
    from torchember import native
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)   # a graph a way and size
    # k tensors a call, so that a compiled function's call (its guards and wrapper, ~50 µs) is shared as in a graph
    ways = {name: torch.compile(lambda xs, f=f: torch.stack([f(x) for x in xs]), dynamic=False)
            for name, f in WAYS.items()}
    ways['native'] = native.moments
    print(f'kernels: {k} float32 tensors a call, median µs a tensor (GB/s); inductor: moments8 (float64 sums), '
          'moments5 (5 moments, float32 sums), welford (8 from float32 reductions); native: the native kernel')
    for size in sizes:
        xs = [torch.randn(size) for _ in range(k)]
        cells = [f'{name} {(us := _median_us(f, xs, n) / k):7.1f} µs ({size * 4 / us / 1e3:4.1f})'
                 for name, f in ways.items()]
        print(f'  {size:>9,} elements: ' + ' | '.join(cells))

_TOKEN = torch.zeros(1)
_TAKEN = []

@torch.library.custom_op('torchember_bench::take', mutates_args=('token',))
def _take(m:torch.Tensor, token:torch.Tensor) -> None:
    "Keep a step's stacked moments (the drain a real design would copy out)."
    _TAKEN.append(m.clone())

@_take.register_fake
def _(m, token): return None

class InGraph:
    "Forward hooks on every module that compute the moments of its float inputs and outputs with torch ops, in the graph."
    def __init__(self, model, fn):
        self.fn, self.root, self.ms = fn, model, []
        for mod in model.modules():
            mod.register_forward_pre_hook(self.pre, with_kwargs=True)
            mod.register_forward_hook(self.post)
    def pre(self, mod, args, kwargs):
        if mod is self.root: self.ms = []
        self.ms = self.ms + [self.fn(a) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    def post(self, mod, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point(): self.ms = self.ms + [self.fn(out)]
        if mod is self.root:
            _take(torch.stack(self.ms), _TOKEN)
            self.ms = []

def _model(variant:str|None, name:str='gpt2'):
    "Model `name` of `bench.py --compile`, compiled whole, armed by `variant` (None: bare); a step timing its forward."
    import compile_bench as cb, corpus
    # as arming does: without guards on module hooks, the hooked model would run the bare model's graph, hooks unseen
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    torch.manual_seed(0)
    model, make, _ = cb.MODELS[name]()
    if variant == 'ember':
        from torchember import torchEmber
        torchEmber(model, run='ingraph', db=str(Path(tempfile.mkdtemp()) / 'ingraph.db'))
    elif variant is not None: InGraph(model, {'graph8': moments8, 'graph5': moments5, 'welford': moments_welford}[variant])
    call, (args, kwargs) = torch.compile(model), make(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step(into:list):
        t0 = time.perf_counter(); out = call(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        corpus.loss_of(out).backward(); opt.step(); opt.zero_grad()
        step.rows = sum(len(m) for m in _TAKEN)   # the moments the graph took this step: none if it ran without hooks
        _TAKEN.clear()
    step.rows = 0
    return step

def pair(variant:str, name:str, steps:int)->dict:
    "Medians of model `name`'s forward, bare and `variant`, stepped in turn (which goes first alternates)."
    bare, armed = _model(None, name), _model(variant, name)
    for _ in range(3): bare([]); armed([])
    b, a = [], []
    for i in range(steps):
        for step, into in ((armed, a), (bare, b)) if i % 2 else ((bare, b), (armed, a)): step(into)
    return dict(bare=statistics.median(b) * 1e6, armed=statistics.median(a) * 1e6, rows=armed.rows)

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--steps', type=int, default=150)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--models', default='gpt2,mlp32', help="of `bench.py --compile`'s: gpt2, mlp32 (none: '')")
    p.add_argument('--quick', action='store_true', help='few steps and calls, small sizes: that it runs, not figures')
    p.add_argument('--pair', choices=VARIANTS, help=argparse.SUPPRESS)   # one variant beside bare, in this process
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.pair: return print(json.dumps(pair(a.pair, a.models, a.steps)))
    print(__doc__.splitlines()[0])
    print(machine_line())
    print(f'torch {torch.__version__} on {a.threads} thread(s)')
    kernels((2**11, 2**15) if a.quick else (2**11, 2**15, 2**17, 2**20), 5 if a.quick else 200)
    steps = 4 if a.quick else a.steps
    for name in filter(None, a.models.split(',')):
        print(f"{name}, compiled whole: a recorded step's forward over bare (medians of {steps} pairs)")
        for v in VARIANTS:
            out = subprocess.run([sys.executable, __file__, '--pair', v, '--models', name, '--steps', str(steps),
                                  '--threads', str(a.threads)], capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows = '' if v == 'ember' else f" ({r['rows']} tensors measured in the graph a step)"
            print(f"  {v:7s} bare {r['bare']:8,.0f} µs, armed {r['armed']:8,.0f} µs: +{r['armed'] - r['bare']:,.0f} µs{rows}")

if __name__ == '__main__': main()
