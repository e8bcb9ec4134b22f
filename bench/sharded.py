"""What recording a sharded model costs: a two-rank FSDP2 job (gloo, CPU) of ~100 parameters, bare and armed side by side.

    python bench/sharded.py [--blocks 16] [--rounds 8] [--steps 5] [--no-merge]

Prints the machine, then per rank: the median step time bare and armed (every step recorded) and their ratio, the
training-thread time a recorded step adds, the collectives a bare and a recorded step make (torch's profiler counts
the `c10d` ops; torchember makes none of its own, so the two should be equal), the rows a recorded step writes
(pieces to `shards`, whole parameters to `stats`), and the writer's time merging pieces per step. A benchmark, not a
test: the figures vary from machine to machine and run to run; the ratios are measured side by side in one job.
"""
import argparse, os, statistics, sys, tempfile, time
from pathlib import Path
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench import machine_line

class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x): return x + self.fc2(torch.relu(self.fc1(self.ln(x))))

class Net(nn.Module):
    def __init__(self, blocks:int):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(32, 64), nn.Sequential(*[Block() for _ in range(blocks)]), nn.Linear(64, 1)
    def forward(self, x): return self.head(self.blocks(self.inp(x)))

def sharded(blocks:int)->nn.Module:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = Net(blocks)
    for b in m.blocks: fully_shard(b)
    return fully_shard(m)

def step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step(); opt.zero_grad()

def collectives(model, opt, x)->int:
    "How many c10d collectives one step makes, as torch's profiler sees them."
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof: step(model, opt, x)
    return sum(1 for e in prof.events() if e.name.startswith('c10d::') and not e.name.startswith('c10d::barrier'))

def worker(rank:int, world:int, init:str, args, out:str):
    os.environ['OMP_NUM_THREADS'] = '1'
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init}', rank=rank, world_size=world)
    import torchember.store as store, torchember.store.write as store_write
    from torchember import torchEmber
    merge_s, merges = [0.], [0]
    merge = store_write.merge_pieces
    def timed(*a, **k):
        t0 = time.perf_counter()
        try: return merge(*a, **k)
        finally: merge_s[0] += time.perf_counter() - t0; merges[0] += 1
    store_write.merge_pieces = timed if not args.no_merge else (lambda *a, **k: None)
    bare, armed = sharded(args.blocks), sharded(args.blocks)
    n_params = len(list(bare.parameters()))
    te = torchEmber(armed, run='sharded-bench', db=str(Path(out).parent/'bench.db'))
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (bare, armed)]
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    for m, o in zip((bare, armed), opts): step(m, o, x); step(m, o, x)   # warm up
    te.flush()
    times = {'bare': [], 'armed': []}
    for _ in range(args.rounds):
        for name, m, o in (('bare', bare, opts[0]), ('armed', armed, opts[1])):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps): step(m, o, x)
            times[name].append((time.perf_counter() - t0) / args.steps)
    te.flush()
    c_bare, c_armed = collectives(bare, opts[0], x), collectives(armed, opts[1], x)
    te.flush()
    steps = te.capture.step + 1
    te.disarm()
    with store.engine(Path(out).parent/'bench.db').connect() as c:
        rows = {t: c.exec_driver_sql(f'SELECT COUNT(*) FROM {t} WHERE rank = {rank}').scalar() for t in ('shards', 'stats')}
        whole = c.exec_driver_sql(f"SELECT COUNT(*) FROM stats WHERE rank = {rank} AND ttype IN ('weight', 'weight_grad')").scalar()
    b, a = statistics.median(times['bare']), statistics.median(times['armed'])
    line = (f"rank {rank}: {n_params} parameters; step bare {b*1e3:.2f} ms, armed {a*1e3:.2f} ms ({a/b:.2f}x, "
            f"+{(a-b)*1e3:.2f} ms a recorded step); collectives a step: bare {c_bare}, recorded {c_armed}; "
            f"rows a recorded step: {rows['shards']/steps:.0f} pieces, {rows['stats']/steps:.0f} stats "
            f"(of them {whole/steps:.0f} whole weights and grads); merging: {merge_s[0]/max(merges[0],1)*1e3:.2f} ms "
            f"a write on the writer thread ({merges[0]} writes)")
    Path(f'{out}.{rank}').write_text(line)
    dist.destroy_process_group()

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--blocks', type=int, default=16)
    p.add_argument('--rounds', type=int, default=8)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--no-merge', action='store_true', help='write the pieces but never merge them: what merging adds')
    args = p.parse_args()
    print(machine_line(), f"torch {torch.__version__}", flush=True)
    tmp = tempfile.mkdtemp()
    os.environ.setdefault('GLOO_SOCKET_IFNAME', 'lo') if sys.platform == 'linux' else None
    mp.spawn(worker, args=(2, f'{tmp}/init', args, f'{tmp}/out'), nprocs=2, join=True)
    for r in range(2): print(Path(f'{tmp}/out.{r}').read_text())
