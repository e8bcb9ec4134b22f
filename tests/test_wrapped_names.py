"Modules named as their user wrote them when training code wraps a submodule (issue 26): activation checkpointing's `checkpoint_wrapper` and `torch.compile` of a submodule."
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchember import torchEmber, load


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)
    def forward(self, x): return x + self.fc2(self.act(self.fc1(x)))


def model(wrap=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 6), Block(), Block(), nn.Linear(6, 1))
    if wrap == 'checkpoint':
        for i in (1, 2): m[i] = checkpoint_wrapper(m[i])
    if wrap == 'compile':
        m[1] = torch.compile(m[1], backend='eager')
    return m


def train(m, db=None, run=None, steps=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g, losses = torch.Generator().manual_seed(1), []
    te = torchEmber(m, run=run, db=db) if db else None
    for _ in range(steps):
        loss = m(torch.randn(4, 3, generator=g)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    if te: te.disarm()
    return losses, {k: v.clone() for k, v in m.state_dict().items()}


def test_checkpoint_wrapped_and_compiled_blocks_keep_their_names(tmp_path):
    db = str(tmp_path / 's.db')
    plain = load('plain', db) if train(model(), db, 'plain') else None
    for wrap in ('checkpoint', 'compile'):
        bare, armed = train(model(wrap)), train(model(wrap), db, wrap)
        assert bare[0] == armed[0] and all(torch.equal(bare[1][k], armed[1][k]) for k in bare[1])   # training unchanged
        r = load(wrap, db)
        mods = r.modules()
        assert mods[['module', 'mtype']].values.tolist() == plain.modules()[['module', 'mtype']].values.tolist(), wrap
        df = r.df(step=1)
        if wrap == 'checkpoint': assert set(df['module']) == set(plain.df(step=1)['module'])
        else: assert set(df['module']) <= set(plain.df(step=1)['module'])   # dynamo may inline a parameter-free call past its hooks
        w = df[df['ttype'] == 'weight_grad']
        assert sorted(w['module'] + '.' + w['tname']) == sorted(f'{n}' for n, _ in model().named_parameters())
        assert not any('_checkpoint_wrapped_module' in n or '_orig_mod' in n for n in r.sequence(1))
