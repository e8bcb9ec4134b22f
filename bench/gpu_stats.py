#!/usr/bin/env python
"""Ways to measure many tensors on an accelerator, timed side by side: which one the stats should use there.

The H200 run of `bench/gpu.py` found a recorded step of a GPT-2-small decoder (about 600 tensors) costing 100 ms
beyond a 30 ms bare step with eager kernels, and `torch.compile` of the fused kernels taking 66 s; a batched
`torch.segment_reduce` path did not finish the benchmark's first model in 100 s. This script times each way on the
tensors of such a step (the activation, weight and grad shapes of one GPT-2-small layer, repeated), so that the next
session with a GPU picks by measurement:

- `eager`: the eight moments of each tensor with eager kernels (`stats._flat8`), what an accelerator runs without Triton;
- `stacked`: tensors cloned as they come, then stacked by shape and reduced a group at a time (`stats._eager_rows`);
- `segments`: tensors copied into one float32 buffer, reduced with `torch.segment_reduce`;
- `triton_one`: the Triton kernels of `torchember.triton_moments`, a launch a tensor (as activations are read);
- `triton_many`: the same, a launch per dtype and size class for the whole list (as weights and grads are read);
- `foreach`: `torch._foreach_norm` over the list, one statistic only: a floor for multi-tensor kernels;
- `compiled` (with `--compile`): `torch.compile` of `stats._flat8`, first call (the compile) timed apart.

For each: the host's µs a tensor to launch the work (what the training thread pays) and the device's µs a tensor
until it is done, medians of `--repeats`, on those tensors and on 200 small ones (where launches are all the cost).
The Triton ways are first checked against `eager`.

    python bench/gpu_stats.py                      # on a CUDA machine
    python bench/gpu_stats.py --device cpu --layers 1   # a smoke test of the script, anywhere
"""
import argparse, os, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from torchember import stats


def gpt2_tensors(device, layers:int, d:int=768, seq:int=512, batch:int=8, dtype=torch.bfloat16)->list:
    "The tensors a recorded step of a GPT-2-small decoder measures, `layers` layers of them: activations in `dtype`, weights and grads in float32."
    act = lambda *s: torch.randn(*s, device=device, dtype=dtype)
    par = lambda *s: torch.randn(*s, device=device)
    out = []
    for _ in range(layers):
        out += [act(batch, seq, d) for _ in range(10)] + [act(batch, seq, 4 * d) for _ in range(2)]   # ln, attn, mlp in/out
        for shape in [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]:
            out += [par(*shape), par(*shape)]                                                        # weight and its grad
    return out


def eager(ts):
    return torch.stack([stats._flat8(t.reshape(-1)) for t in ts])

def stacked(ts):
    groups = {}
    for t in ts: groups.setdefault((t.shape, t.dtype), []).append(t.clone())
    return [stats._eager_rows(torch.stack(g).reshape(len(g), -1), counts=True) for g in groups.values()]

def segments(ts, chunk:int=2**24):
    out, buf, lens, off = [], None, [], 0
    def reduce():
        n = torch.tensor(lens, dtype=torch.int64)
        if buf.device.type != 'cpu': n = n.pin_memory().to(buf.device, non_blocking=True)
        x = buf[:off]
        seg = lambda v, how: torch.segment_reduce(v, how, lengths=n, unsafe=True)
        d = x.double()
        out.append(torch.stack([seg(d, 'sum'), seg(d * d, 'sum'), seg(x, 'min').double(), seg(x, 'max').double(),
                                seg((x != 0).double(), 'sum'), seg(x.isnan().double(), 'sum'), seg(x.isinf().double(), 'sum')], 1))
    for t in ts:
        k = t.numel()
        if k > chunk: out.append(stats._flat8(t.reshape(-1))[None]); continue
        if buf is not None and off + k > chunk: reduce(); buf, lens, off = None, [], 0
        if buf is None: buf = torch.empty(chunk, dtype=torch.float32, device=t.device)
        buf[off:off + k].copy_(t.reshape(-1))
        lens.append(k); off += k
    if lens: reduce()
    return out

def triton_one(ts):
    from torchember import triton_moments
    P = triton_moments.Partials(ts[0].device)
    for t in ts: P.add(t)
    return P.finish()

def triton_many(ts):
    from torchember import triton_moments
    P = triton_moments.Partials(ts[0].device)
    order = P.add_many(ts)
    m = P.finish()
    return m[torch.tensor(order, device=m.device).argsort()]   # in the order of `ts`

def agree(ts, device):
    "Print the Triton kernels' first call (their compile) and their largest relative difference from `eager` per moment."
    t0 = time.perf_counter(); triton_one(ts[:1]); sync(device)
    print(f"triton: first call (compiles) {time.perf_counter() - t0:.2f} s")
    x = torch.randn(1000, device=device); x[3], x[5], x[7] = float('nan'), float('inf'), 0
    ref = eager(ts + [x])
    rel = lambda got: ((got - ref).abs() / ref.abs().clamp_min(1e-30)).nan_to_num(0).amax(0).tolist()
    print("triton_one against eager, largest relative difference per moment:", rel(triton_one(ts + [x])))
    print("triton_many against eager:", rel(triton_many(ts + [x])))

def foreach(ts):
    return torch._foreach_norm(ts)


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def timed(fn, ts, device, repeats:int)->tuple:
    "Median host µs and device µs a tensor of `fn(ts)` over `repeats` calls, after one untimed call."
    fn(ts); sync(device)
    host, done = [], []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn(ts)
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) / len(ts) * 1e6); done.append((t2 - t0) / len(ts) * 1e6)
    return statistics.median(host), statistics.median(done)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--layers', type=int, default=12)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--ways', default='eager,stacked,triton_one,triton_many,foreach')
    p.add_argument('--compile', action='store_true', help="also time `torch.compile` of the fused kernel (its compile apart)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == 'cuda' and not torch.cuda.is_available(): sys.exit("no CUDA device here: run with --device cpu to check the script")
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'
    small = device.type == 'cpu'
    ts = gpt2_tensors(device, a.layers, **(dict(d=64, seq=32, batch=2) if small else {}))
    print(f"device: {name}; torch {torch.__version__}; {len(ts)} tensors, {sum(t.numel() for t in ts) / 1e6:.0f}M elements")
    ways = {w: globals()[w] for w in a.ways.split(',')}
    if device.type == 'cpu' and os.environ.get('TRITON_INTERPRET') != '1':   # Triton compiles for accelerators only
        ways = {w: f for w, f in ways.items() if not w.startswith('triton')}
    if a.compile:
        f = torch.compile(stats._flat8, dynamic=True)
        t0 = time.perf_counter(); f(ts[0].reshape(-1)); sync(device)
        print(f"compiled: first call (the compile) {time.perf_counter() - t0:.1f} s")
        ways['compiled'] = lambda ts: torch.stack([f(t.reshape(-1)) for t in ts])
    if 'triton_one' in ways or 'triton_many' in ways: agree(ts, device)
    small = [torch.randn(100, device=device) for _ in range(200)]
    print(f"{'way':<12} {'host µs/tensor':>15} {'done µs/tensor':>15} {'200 small: host':>16} {'done':>8}")
    for w, fn in ways.items():
        try: h, d = timed(fn, ts, device, a.repeats); hs, ds = timed(fn, small, device, a.repeats)
        except Exception as e:
            print(f"{w:<12} failed: {type(e).__name__}: {e}"); continue
        print(f"{w:<12} {h:15.1f} {d:15.1f} {hs:16.1f} {ds:8.1f}", flush=True)


if __name__ == '__main__':
    main()
