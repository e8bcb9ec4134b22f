"""One rank of `test_sharded_compile.py`: FSDP2 per block in torchtitan's order (arm, compile, shard), and compiled DDP.

Run as `python sharded_compile_worker.py STORE OUT` with torch.distributed's environment variables set (2 ranks, gloo,
CPU). Per setup, trained bare and armed: `arm_shard` (armed, then each block and the root `fully_shard`ed, eager),
`arm_compile_shard` (armed, each block `.compile(fullgraph=True)`, then sharded), `arm_compile_ddp` (armed,
`torch.compile(model)`, then `DistributedDataParallel` of that: nanoGPT's order) and `arm_ddp_compile` (armed, DDP, then
`torch.compile` of the DDP module); and `arm_compile_shard_lean` and `arm_compile_ddp_lean`, the second and third
with `every=2, bare_unrecorded=True`.
DDP's buckets are made small, so dynamo's DDP optimizer splits the compiled graph at each bucket's end and the
recording crosses the pieces. It writes `OUT.r.json` for rank `r`:
the losses bare and armed, dynamo's graph breaks and graphs, and per step the default stats of every whole parameter
and grad, gathered with `full_tensor()`: what the store must hold, merged from the ranks' pieces.
"""
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torchember import torchEmber
from sharded_worker import Net, dtensor_full, stats_of, D

SETUPS = ('arm_shard', 'arm_compile_shard', 'arm_compile_ddp', 'arm_ddp_compile', 'arm_compile_shard_lean',
          'arm_compile_ddp_lean')
if hasattr(dist, '_DEFAULT_FIRST_BUCKET_BYTES'): dist._DEFAULT_FIRST_BUCKET_BYTES = 64   # DDP's first bucket; the others:
BUCKET_MB = 0.0001 if hasattr(dist, '_DEFAULT_FIRST_BUCKET_BYTES') else 25    # ... a bucket a parameter or two

def train(setup:str, db=None, steps:int=3):
    "Train `setup` bare (`db` None) or armed into `db`: losses, whole-parameter stats per step, breaks and graphs."
    from torch._dynamo.utils import counters
    torch._dynamo.reset(); counters.clear()
    torch.manual_seed(0)
    model = Net()
    lean = setup.endswith('_lean')   # every=2 and `bare_unrecorded`: unrecorded steps run a hook-free graph
    how = setup.removesuffix('_lean')
    # armed first: before compiling and sharding
    te = torchEmber(model, run=setup, db=db, every=2 if lean else 1, bare_unrecorded=lean) if db else None
    call = model
    if how == 'arm_compile_ddp': call = DDP(torch.compile(model), bucket_cap_mb=BUCKET_MB)
    elif how == 'arm_ddp_compile': call = torch.compile(DDP(model, bucket_cap_mb=BUCKET_MB))
    else:
        if 'compile' in how:
            for b in model.blocks: b.compile(fullgraph=True)
        for b in model.blocks: fully_shard(b)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses, ref = [], []
    for _ in range(steps):
        w = stats_of(dtensor_full(model, False)) if te else None
        loss = call(torch.randn(8, 3, generator=g)).pow(2).mean()
        loss.backward()
        if te: ref.append(dict(weight=w, weight_grad=stats_of(dtensor_full(model, True))))
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    if te: te.disarm()
    return dict(losses=losses, ref=ref, breaks=sum(counters['graph_break'].values()), graphs=counters['stats']['unique_graphs'])

if __name__ == '__main__':
    db, out = sys.argv[1], sys.argv[2]
    dist.init_process_group('gloo')
    res = {s: dict(bare=train(s), armed=train(s, db)) for s in SETUPS}
    with open(f'{out}.{dist.get_rank()}.json', 'w') as f: json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)      # gloo's threads can abort a finishing interpreter now and then (SIGABRT, torch's, not ours)
