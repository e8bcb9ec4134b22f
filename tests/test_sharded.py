"""Sharded training, first steps (issue 26): FSDP2 on two CPU ranks (gloo), armed as it is.

What holds today, and is checked here: training stays bit-identical to the bare sharded model; module types are the
classes the user wrote, not FSDP2's `FSDP<Name>` subclasses; each rank's weight and weight-grad rows describe one
and the same tensor, its local shard (shape, numel and stats agree, an empty shard is numel 0); a custom stat
function is handed the shard, never the DTensor, so it can make no collective, and with `ranks=[0]` the job
finishes instead of hanging. Not yet: one row per parameter with the full parameter's stats merged from the shards.
"""
import json, math, os, socket, subprocess, sys, textwrap
import pytest, torch
from torchember import load

WORKER = textwrap.dedent('''
    import json, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torchember import torchEmber

    db, out = sys.argv[1], sys.argv[2]
    dist.init_process_group('gloo')
    rank = dist.get_rank()

    class Block(nn.Module):
        def __init__(self, d=6):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)
        def forward(self, x): return x + self.fc2(self.act(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.blocks = nn.Linear(3, 6), nn.ModuleList([Block(), Block()])
            self.head, self.out = nn.Linear(6, 5), nn.Linear(5, 1)   # 5 rows split 3/2; 1 row leaves rank 1 an empty shard
        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks: x = b(x)
            return self.out(torch.relu(self.head(x)))

    def train(run=None, steps=3, custom=False, **kw):
        torch.manual_seed(0)
        net = Net()
        for b in net.blocks: fully_shard(b)
        fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        te = torchEmber(net, run=run, db=db, **kw) if run else None
        if custom:
            @te.how_record_weight
            def mean_norm(t): return {'mean': t.mean(), 'norm': t.norm()}
        losses, shards, before = [], {}, []
        for step in range(steps):
            before.append(net.inp.weight.to_local().detach().double().mean().item())   # the shard the step's weights row sees
            loss = net(torch.randn(4, 3, generator=g)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        for n, p in net.named_parameters():
            loc = p.to_local().detach()
            shards[n] = dict(shape=list(loc.shape), full=list(p.shape), sum=loc.double().sum().item())
        if te: te.disarm()
        return dict(losses=losses, shards=shards, before=before)

    res = dict(bare=train(), armed=train('fsdp2'), rank0=train('fsdp2-rank0', custom=True, ranks=[0]))
    with open(f'{out}.{rank}.json', 'w') as f: json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
''')

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

@pytest.fixture(scope='module')
def fsdp2(tmp_path_factory):
    "One two-rank FSDP2 job: bare, armed, and armed on rank 0 only with a custom stat function; the store and each rank's results."
    pytest.importorskip('torch.distributed.fsdp')
    if not torch.distributed.is_available(): pytest.skip('torch.distributed is not available')
    tmp = tmp_path_factory.mktemp('fsdp2')
    db, script, out = str(tmp/'store.db'), tmp/'worker.py', tmp/'result'
    script.write_text(WORKER)
    env = {**os.environ, 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(free_port()), 'WORLD_SIZE': '2',
           'TORCHEMBER_COMPILE': '0', 'OMP_NUM_THREADS': '1'}
    if sys.platform == 'linux': env.setdefault('GLOO_SOCKET_IFNAME', 'lo')
    ps = [subprocess.Popen([sys.executable, str(script), db, str(out)], env={**env, 'RANK': str(r)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    failed = []
    try:
        for r, p in enumerate(ps):
            _, err = p.communicate(timeout=180)           # a hang (a collective only one rank makes) fails here
            if p.returncode: failed.append(f'rank {r} exited with {p.returncode}:\n{err[-3000:]}')
    finally:
        for p in ps:
            if p.poll() is None: p.kill()
    assert not failed, '\n'.join(failed)
    return db, [json.loads((tmp/f'result.{r}.json').read_text()) for r in range(2)]

def test_training_is_bit_identical(fsdp2):
    _, res = fsdp2
    for r in res: assert r['armed']['losses'] == r['bare']['losses'] and r['rank0']['losses'] == r['bare']['losses']

def test_types_are_the_users_classes(fsdp2):
    db, _ = fsdp2
    run = load('fsdp2', db)
    assert run.model == 'Net'
    types = dict(zip(run.modules()['module'], run.modules()['mtype']))
    assert types[''] == 'Net' and types['blocks.0'] == 'Block' and types['blocks.1.fc2'] == 'Linear'
    assert not any(t.startswith('FSDP') for t in set(run.df()['mtype']))

def test_each_rank_records_its_shard_consistently(fsdp2):
    db, res = fsdp2
    run = load('fsdp2', db)
    assert run.ranks == [0, 1]
    last = run.df(step=2, ttype='weight')   # the weights step 2 began with: the shards after two optimizer steps
    for rank in (0, 1):
        mine = last[last['rank'] == rank]
        for _, row in mine.iterrows():
            name = f"{row['module']}.{row['tname']}" if row['module'] else row['tname']
            shard = res[rank]['armed']['shards'][name]
            assert list(row['shape']) == shard['shape'] and row['numel'] == math.prod(shard['shape'])
    both = last.groupby(['module', 'tname'])['numel'].sum()
    assert both[('head', 'weight')] == 30 and both[('out', 'weight')] == 5      # the shards of each parameter add up to it
    empty = last[(last['module'] == 'out') & (last['tname'] == 'weight') & (last['rank'] == 1)]
    assert empty['numel'].tolist() == [0]
    grads = run.df(step=2, ttype='weight_grad')
    assert set(grads['rank']) == {0, 1} and (grads['numel'] == [math.prod(s) for s in grads['shape']]).all()

def test_a_custom_stat_gets_the_shard_and_rank_0_alone_does_not_hang(fsdp2):
    db, res = fsdp2
    run = load('fsdp2-rank0', db)
    assert run.ranks == [0]
    w = run.df(ttype='weight')
    assert len(w) and w['mean'].notna().all() and w['norm'].notna().all()
    inp = w[(w['module'] == 'inp') & (w['tname'] == 'weight')].sort_values('step')
    assert inp['shape'].tolist() == [(3, 3)] * 3                                  # rank 0's half of inp.weight (6, 3)
    assert inp['mean'].to_numpy() == pytest.approx(res[0]['rank0']['before'], rel=1e-5)   # the custom stat of that half
