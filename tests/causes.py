"Runs that go wrong in known ways, each with its known cause: small models, a couple of hundred steps on a CPU."
import math
import torch
from torch import nn
import torch.nn.functional as F
from contextlib import contextmanager
from torchember import torchEmber, load
from torchember.store import writer

@contextmanager
def one_thread():
    "Train on one thread, every step kept: two threads on a busy 2-core machine make each step 50x slower, and a writer"
    # that falls behind drops steps evenly (`store.writer.BEHIND_S`): these runs' causes must be in the store, whatever the load
    n, behind = torch.get_num_threads(), getattr(writer, 'BEHIND_S', None)
    torch.set_num_threads(1)
    if behind is not None: writer.BEHIND_S = 1e9
    try: yield
    finally:
        torch.set_num_threads(n)
        if behind is not None: writer.BEHIND_S = behind

class Block(nn.Module):
    "A pre-norm decoder block: attention, then an MLP (`mlp.fc`, `mlp.act`, `mlp.proj`)."
    def __init__(self, d:int, heads:int=4):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), nn.MultiheadAttention(d, heads, batch_first=True), nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.add_module('fc', nn.Linear(d, 4 * d)); self.mlp.add_module('act', nn.GELU()); self.mlp.add_module('proj', nn.Linear(4 * d, d))
    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    "A tiny GPT-like decoder: token embedding, `n` blocks, a final LayerNorm and a head."
    def __init__(self, vocab:int=64, d:int=64, n:int=4, ctx:int=16):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
    def forward(self, idx):
        x = self.emb(idx) + self.pos[:idx.shape[1]]
        for b in self.blocks: x = b(x)
        return self.head(self.ln_f(x))

def scaled_weight(db, run='scaled-weight', at:int=60, steps:int=90, block:int=1):
    "GPT, AdamW (weight decay 0.1): at iteration `at` one block's `mlp.proj` weight x1e4 and its lr 100; the loss turns NaN later."
    # lr 100 x weight decay 0.1 multiplies the weight by 1 - 10 = -9 every step: it overflows some 15 steps later
    torch.manual_seed(0)
    m = GPT()
    proj = m.blocks[block].mlp.proj
    hot = {id(p) for p in proj.parameters()}
    opt = torch.optim.AdamW([{'params': [p for p in m.parameters() if id(p) not in hot], 'lr': 1e-3},
                             {'params': list(proj.parameters()), 'lr': 1e-3}], weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    with one_thread(), torchEmber(m, run=run, db=db, overwrite=True) as te:
        for s in range(steps):
            if s == at:
                with torch.no_grad(): proj.weight.mul_(1e4)
                opt.param_groups[1]['lr'] = 100.
            idx = torch.randint(0, 64, (8, 16), generator=g)
            loss = F.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            opt.zero_grad(); loss.backward(); opt.step()
            te.log(loss=loss)
    return load(run, db)

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.conv2, self.act2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv3, self.act3 = nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        self.flat, self.fc = nn.Flatten(), nn.Linear(16 * 4 * 4, 10)
    def forward(self, x):
        x = self.pool(self.act2(self.conv2(self.act1(self.conv1(x)))))
        return self.fc(self.flat(self.act3(self.conv3(x))))

def _images(g, n=16):
    x = torch.randn(n, 3, 8, 8, generator=g)
    return x, (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()

def hot_lr(db, run='hot-lr', at:int=60, steps:int=120):
    "CNN, SGD at lr 0.02: `conv2`'s learning rate jumps to 50 at iteration `at`; nothing turns NaN."
    torch.manual_seed(0)
    m = CNN()
    rest = [p for n, p in m.named_parameters() if not n.startswith('conv2.')]
    opt = torch.optim.SGD([{'params': rest, 'lr': 0.02}, {'params': list(m.conv2.parameters()), 'lr': 0.02}])
    g = torch.Generator().manual_seed(1)
    with one_thread(), torchEmber(m, run=run, db=db, overwrite=True) as te:
        for s in range(steps):
            if s == at: opt.param_groups[1]['lr'] = 50.
            x, y = _images(g)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            te.log(loss=loss)
    return load(run, db)

def mlp(width:int=32, depth:int=3):
    torch.manual_seed(0)
    layers = []
    for i in range(depth): layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))

def _fit(m, run, db, steps, tweak=None, batch=None, lr=3e-3, **kw):
    "Fit a fixed random linear map; `tweak(step, m)` runs before each forward, `batch(step, x)` may change the inputs."
    g = torch.Generator().manual_seed(1)
    d = m[0].in_features
    target = torch.randn(d, 1, generator=g) / d ** .5
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    with one_thread(), torchEmber(m, run=run, db=db, overwrite=True, **kw) as te:
        for s in range(steps):
            if tweak: tweak(s, m)
            x = torch.randn(32, d, generator=g)
            y = x @ target
            if batch: x = batch(s, x)
            loss = F.mse_loss(m(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            te.log(loss=loss)
    return load(run, db)

def bad_batch(db, run='bad-batch', at:int=70, steps:int=120):
    "MLP: the inputs of the batch of step `at` are multiplied by 1e3, once."
    return _fit(mlp(), run, db, steps, batch=lambda s, x: x * 1e3 if s == at else x)

def dying_layer(db, run='dying', at:int=40, steps:int=120, layer:int=2):
    "MLP: from iteration `at`, layer `layer` fades out: its weights shrink by 5% every step, faster than Adam regrows them."
    def tweak(s, m):
        if s >= at:
            with torch.no_grad(): m[layer].weight.mul_(0.95)
    return _fit(mlp(), run, db, steps, tweak=tweak)

class Half(nn.Linear):
    "A Linear that computes in float16 (as under autocast) and hands back float32."
    def forward(self, x): return F.linear(x.half(), self.weight.half(), self.bias.half()).float()

def fp16_overflow(db, run='fp16', at:int=60, steps:int=120):
    "MLP with a float16 layer `2`: from iteration `at` its weight grows 1.5x a step, until its output passes 65504 (Inf)."
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), Half(32, 32), nn.ReLU(), nn.Linear(32, 1))
    def tweak(s, m):
        if s >= at:
            with torch.no_grad(): m[2].weight.mul_(1.5)
    return _fit(m, run, db, steps, tweak=tweak, lr=1e-3)

def drift_to_layernorm(db, run='drift', at:int=50, steps:int=150):
    "MLP, then a LayerNorm: from iteration `at` the first Linear's weight grows 2x a step, until the LayerNorm overflows."
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    def tweak(s, m):
        if s >= at:
            with torch.no_grad(): m[0].weight.mul_(2.)
    return _fit(m, run, db, steps, tweak=tweak, lr=1e-3)

CASES = {   # name -> (make the run, the module that started it, the step it starts at)
    'scaled_weight': (scaled_weight, 'blocks.1.mlp.proj', 60),
    'hot_lr': (hot_lr, 'conv2', 61),
    'bad_batch': (bad_batch, '', 70),   # the model's input: the batch
    'dying_layer': (dying_layer, '2', 40),
    'fp16_overflow': (fp16_overflow, '2', 60),
    'drift_to_layernorm': (drift_to_layernorm, '0', 50),
}
