"""One rank of the sharded-training job `test_sharded.py` launches: every setup trained bare, then armed, then checked.

Run as `python sharded_worker.py STORE OUT` with torch.distributed's environment variables set (2 ranks, gloo, CPU).
Per setup it writes, for rank `r`, `OUT.r.json`: the losses bare and armed, the module types, and per recorded step the
default stats of every whole parameter and its grad, computed here from the gathered tensors (`full_tensor()`, or
FSDP1's flat shards gathered by hand): what the store must hold, merged from the ranks' pieces.
"""
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torchember import torchEmber
from torchember.core import user_modules
from torchember.stats import default_stats, STATS

D = 6

class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)
    def forward(self, x): return x + self.fc2(self.act(self.fc1(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.norm = nn.Linear(3, D), nn.ModuleList([Block(), Block()]), nn.LayerNorm(D)
        self.head, self.out = nn.Linear(D, 5), nn.Linear(5, 1)   # 5 rows split 3/2; 1 row leaves rank 1 an empty shard
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks: x = b(x)
        return self.out(torch.relu(self.head(self.norm(x))))

class MLP(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)
    def forward(self, x): return self.fc2(self.act(self.fc1(x)))

def build(setup:str):
    "The model of `setup`, sharded, initialised alike on every rank."
    torch.manual_seed(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if setup in ('tp', '2d'):
        from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
        m, plan = MLP(), {'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()}
        if setup == 'tp': parallelize_module(m, init_device_mesh('cpu', (2,), mesh_dim_names=('tp',)), plan)
        else:
            mesh = init_device_mesh('cpu', (1, 2), mesh_dim_names=('dp', 'tp'))
            parallelize_module(m, mesh['tp'], plan)
            fully_shard(m, mesh=mesh['dp'])
        return m
    m = Net()
    if setup.startswith('fsdp1'):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FSDP(m, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=setup == 'fsdp1_orig', device_id=torch.device('cpu'))
    if setup == 'fsdp2_ac':
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, Block))
    kw = {'mesh': init_device_mesh('cpu', (2, 1), mesh_dim_names=('replicate', 'shard'))} if setup == 'hsdp' else {}
    for b in m.blocks: fully_shard(b, **kw)
    fully_shard(m, **kw)
    return m

def names(model:nn.Module)->dict:
    "id(module) -> its name as the user wrote it."
    inner = model
    while hasattr(inner, '_fsdp_wrapped_module'): inner = inner._fsdp_wrapped_module
    return {id(m): n for n, m in user_modules(inner)}

def fsdp1_full(model, grads:bool)->dict:
    "Every parameter (or grad) of an FSDP1 model, whole: each flat parameter's shards gathered, cut at its parameters."
    named, out = names(model), {}
    for m in model.modules():
        fp = getattr(getattr(m, '_handle', None), 'flat_param', None)
        if fp is None: continue
        loc = (fp.grad if grads else getattr(fp, "_local_shard", fp)).detach().contiguous()
        parts = [torch.empty_like(loc) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, loc)
        flat, off, k = torch.cat(parts), 0, 0
        for n, pad in zip(fp._numels_with_padding, fp._is_padding_mask):
            if not pad:
                info = fp._param_infos[k]
                mod = named[id(info.module)]
                out[f'{mod}.{info.param_name}' if mod else info.param_name] = flat[off:off + n].reshape(fp._shapes[k])
                k += 1
            off += n
    return out

def dtensor_full(model, grads:bool)->dict:
    "Every parameter (or grad) of a DTensor model, whole (`full_tensor()`), under the user's names."
    named, out = names(model), {}
    for m in model.modules():
        if id(m) not in named: continue
        for pn, p in m._parameters.items():
            t = p.grad if grads else p
            if t is None: continue
            full = t.full_tensor() if hasattr(t, 'full_tensor') else t
            out[f'{named[id(m)]}.{pn}' if named[id(m)] else pn] = full.detach()
    return out

def stats_of(ts:dict)->dict:
    return {n: [float(v) for v in default_stats(t).values()] for n, t in ts.items()}

def mean_norm(t): return {'mean': t.mean(), 'norm': t.norm()}   # no count: cannot be merged, recorded per shard

def train(setup:str, db=None, steps:int=3, custom:bool=False):
    model = build(setup)
    rank = dist.get_rank()
    te = torchEmber(model, run=setup + '-custom' * custom, db=db, hist=4 * custom, track_updates=custom) if db else None
    if custom: te.how_record_grad(mean_norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    same = setup in ('tp', '2d')                      # tensor parallel ranks take the same batch
    g = torch.Generator().manual_seed(100 + (0 if same else rank))
    full = setup.startswith('fsdp1') and fsdp1_full or dtensor_full
    losses, ref, prev = [], [], None
    for step in range(steps):
        whole = full(model, False) if te else None
        w = stats_of(whole) if te else None
        if custom:    # how far each whole weight moved since the last step, the same as `update_norm` of the merged pieces
            for n, t in whole.items(): w[n].append(0. if prev is None else float((t - prev[n]).double().norm()))
            prev = {n: t.clone() for n, t in whole.items()}
        x = torch.randn(8, D if same else 3, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        if te: ref.append(dict(weight=w, weight_grad=stats_of(full(model, True))))
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    types = None
    if te:
        types = dict(zip(te.capture.names, te.capture.mtypes))
        te.disarm()
    return losses, ref, types

def refused(setup:str, db:str)->str:
    "What arming `setup` on rank 0 alone says."
    try: torchEmber(build(setup), run=f'{setup}-rank0', db=db, ranks=[0])
    except ValueError as e: return str(e)
    return ''

def by_callback(db:str)->list:
    "FSDP2 trained under `EmberCallback` (as a trainer's main rank would set it up): the ranks that recorded."
    from torchember.callbacks import EmberCallback
    model, rank = build('fsdp2'), dist.get_rank()
    cb = EmberCallback(db=db)
    te = cb.begin(model, 'fsdp2-callback', rank=rank, main=rank == 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        model(torch.randn(8, 3)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
    cb.end()
    return [] if te is None else [te.run_name, rank]

def lone(db:str)->list:
    "FSDP2 armed on rank 0 alone, by hand: what it warns."
    import warnings
    model, rank = build('fsdp2'), dist.get_rank()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        te = torchEmber(model, run='fsdp2-lone', db=db) if rank == 0 else None
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(5):
            model(torch.randn(8, 3)).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
            if te: te.flush()
        if te: te.disarm()
    return [str(w.message) for w in said if 'torchember' in str(w.message)]

if __name__ == '__main__':
    db, out = sys.argv[1], sys.argv[2]
    dist.init_process_group('gloo')
    res = {}
    for setup in sys.argv[3].split(','):
        bare, _, _ = train(setup)
        armed, ref, types = train(setup, db)
        res[setup] = dict(bare=bare, armed=armed, ref=ref, types=types)
    _, ref, _ = train('fsdp2', db, custom=True)
    res['fsdp2-custom'] = dict(ref=ref)
    res['refused'] = {s: refused(s, db) for s in ('fsdp2', 'fsdp1', 'tp')}
    res['callback'], res['lone'] = by_callback(db), lone(db)
    with open(f'{out}.{dist.get_rank()}.json', 'w') as f: json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)      # gloo's threads can abort a finishing interpreter now and then (SIGABRT, torch's, not ours)
