"""Four real training scripts, shrunk to run in about a second on two CPU cores, for `test_real_scripts.py`.

Each keeps what made its original awkward to arm (issue 25):

- `nanogpt`: nanoGPT's `train.py` on a char-level transformer (tied embedding and head, causal attention with a
  `tril` mask, dropout), AdamW with decay groups, batches drawn with `torch.randint` on the global RNG, a loss
  estimate every `eval_interval` iterations in eval mode under `no_grad`, `grad_accum` micro-steps per optimizer step
  and `clip_grad_norm_`. It estimates the loss once more after the last optimizer step (nanoGPT's own loop trains one
  iteration past its last estimate), so its newest step is an eval call.
- `dcgan`: PyTorch's DCGAN example: a conv generator and discriminator, both armed (two runs, one store), a
  `DataLoader` with two forked workers re-forked each epoch, per iteration D on real, D on `fake.detach()`,
  `optD.step()`, D on fake for G's loss, `optG.step()`; every `sample_every` iterations G samples under `no_grad`,
  still in train mode.
- `lstm_lm`: PyTorch's word_language_model: embedding, LSTM, decoder, hidden state carried and detached between
  batches, SGD written by hand (no `torch.optim`), then `torch.save(model)`, `torch.load` and an evaluation of the
  reloaded model. Its vocabulary makes the embedding, the decoder weight and the logits 2**20 elements, the size
  from which torchember times its kernels (`torchember.native.LARGE`).
- `lbfgs`: PyTorch's time_sequence_prediction: `LSTMCell`s unrolled over a sine wave in float64, trained by
  `LBFGS(max_iter=20)` whose closure calls the model up to 20 times an optimizer step, then a prediction under
  `no_grad` in train mode.

Every script is `fn(armed, tmp_path, seed=0, <its knobs>, **ember)`: it seeds with `torch.manual_seed(seed)`, trains
and returns a dict: `losses` (python floats), `state` (name -> tensor, cloned at the end), what the loop did
(optimizer steps, eval and sample points, the grads each optimizer step applied), and when `armed` the `torchEmber`
object(s) as `te`, the run name(s) as `run` and the store path as `db`. `ember` goes to `torchEmber` (hist=,
timing=, ...). Each model is disarmed before the script returns, so its store holds every step.
"""
import math, zipfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchember import torchEmber

__all__ = ['nanogpt', 'dcgan', 'lstm_lm', 'lbfgs', 'SCRIPTS', 'GPT', 'Generator', 'Discriminator', 'RNNModel',
           'Sequence', 'param_grads']


def _state(*named) -> dict:
    "Clones of every state_dict tensor of the `(prefix, model)` pairs."
    return {f'{p}{k}': v.detach().clone() for p, m in named for k, v in m.state_dict().items()}

def _arm(armed: bool, model: nn.Module, run: str, db: Path, ember: dict):
    db.parent.mkdir(parents=True, exist_ok=True)     # the bare run writes its torch.save file there too
    return torchEmber(model, run=run, db=str(db), overwrite=True, **ember) if armed else None

def param_grads(model: nn.Module) -> dict:
    "`(module name, parameter name)` -> a clone of its grad, each parameter under the first module owning it."
    seen, out = set(), {}
    for n, m in model.named_modules():
        for k, p in m._parameters.items():
            if p is None or id(p) in seen: continue
            seen.add(id(p))
            if p.grad is not None: out[n, k] = p.grad.detach().clone()
    return out


# ---------------------------------------------------------------- nanoGPT

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head = n_head
        self.register_buffer('bias', torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)
    def forward(self, x): return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd, dropout)
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    "nanoGPT's model: token and position embeddings, `n_layer` blocks, a LayerNorm, a head tied to the token embedding."
    def __init__(self, vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight          # weight tying, as nanoGPT does
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'): nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)): nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None: nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h: x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None: return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
        "all that glitters is not gold. where there is smoke there is fire. ") * 12

def nanogpt(armed: bool, tmp_path, seed: int = 0,
            max_iters: int = 4,        # optimizer steps
            eval_interval: int = 2,    # estimate the losses before iterations 0, eval_interval, ... and after the last
            eval_iters: int = 2,       # batches per split of each estimate
            grad_accum: int = 2,       # micro-steps per optimizer step
            batch_size: int = 8, block_size: int = 16,
            clip: float = 1.0,         # clip_grad_norm_'s max norm; None: no clipping
            run: str = 'nanogpt', **ember) -> dict:
    "nanoGPT's train loop: evals, `grad_accum` micro-steps, clipping; `applied[k]`: the grads optimizer step k applied."
    torch.manual_seed(seed)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT], dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {'train': data[:n], 'val': data[n:]}
    def get_batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - block_size, (batch_size,))
        return torch.stack([d[i:i + block_size] for i in ix]), torch.stack([d[i + 1:i + 1 + block_size] for i in ix])

    model = GPT(len(chars), block_size=block_size)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99))
    db = Path(tmp_path)/'nanogpt.db'
    te = _arm(armed, model, run, db, ember)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in splits:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    losses, evals, applied, norms = [], [], [], []
    X, Y = get_batch('train')
    for iter_num in range(max_iters + 1):
        if iter_num % eval_interval == 0 or iter_num == max_iters:
            est = estimate_loss()
            losses += [est['train'], est['val']]
            evals.append(iter_num)
        if iter_num == max_iters: break
        for micro_step in range(grad_accum):
            _, loss = model(X, Y)
            loss = loss / grad_accum
            X, Y = get_batch('train')            # prefetch, as nanoGPT does, while the backward would run on a GPU
            loss.backward()
            losses.append(loss.item() * grad_accum)
        if clip is not None: norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        applied.append(param_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if te is not None: te.disarm()
    return dict(losses=losses, state=_state(('', model)), opt_steps=max_iters, evals=evals,
                eval_calls=2 * eval_iters, grad_accum=grad_accum, applied=applied, grad_norms=norms,
                te=te, run=run if armed else None, db=str(db) if armed else None, model=model)


# ---------------------------------------------------------------- DCGAN

class Generator(nn.Module):
    def __init__(self, nz=8, ngf=8, nc=1):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),   # 4x4
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),      # 8x8
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())                                   # 16x16
    def forward(self, input): return self.main(input)

class Discriminator(nn.Module):
    def __init__(self, ndf=8, nc=1):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),                        # 8x8
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),                                                                 # 4x4
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())
    def forward(self, input): return self.main(input).view(-1, 1).squeeze(1)

def _weights_init(m):
    name = type(m).__name__
    if 'Conv' in name: nn.init.normal_(m.weight, 0.0, 0.02)
    elif 'BatchNorm' in name: nn.init.normal_(m.weight, 1.0, 0.02); nn.init.zeros_(m.bias)

def _images(n: int, size: int = 16) -> torch.Tensor:
    "`n` synthetic 1x`size`x`size` images in [-1, 1]: a bright disc at a random place on a dark ground."
    g = torch.Generator().manual_seed(1234)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing='ij')
    c = torch.randint(4, size - 4, (n, 2, 1, 1), generator=g)
    d = ((yy - c[:, 0]) ** 2 + (xx - c[:, 1]) ** 2).float()
    return (torch.exp(-d / 8) * 2 - 1).unsqueeze(1)

def dcgan(armed: bool, tmp_path, seed: int = 0,
          epochs: int = 2,          # each forks the DataLoader's workers again
          n_images: int = 64, batch_size: int = 16,
          sample_every: int = 3,    # G samples its fixed noise under no_grad after these iterations (0, 3, ...)
          num_workers: int = 2, nz: int = 8,
          run: str = 'dcgan', **ember) -> dict:
    """The DCGAN example's loop, into runs `{run}-D` and `{run}-G`; `samples`: the iterations after which G sampled;
    `applied['D'][k]`: the grads the k-th `optD.step()` applied (`'G'` likewise)."""
    torch.manual_seed(seed)
    netG, netD = Generator(nz), Discriminator()
    netG.apply(_weights_init); netD.apply(_weights_init)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(batch_size, nz, 1, 1)
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    db = Path(tmp_path)/'dcgan.db'
    runs = dict(D=f'{run}-D', G=f'{run}-G')
    tes = dict(D=_arm(armed, netD, runs['D'], db, ember), G=_arm(armed, netG, runs['G'], db, ember))
    ctx = dict(multiprocessing_context='fork') if num_workers else {}
    loader = DataLoader(TensorDataset(_images(n_images)), batch_size=batch_size, shuffle=True,
                        num_workers=num_workers, **ctx)
    losses, samples, it, applied = [], [], 0, dict(D=[], G=[])
    for epoch in range(epochs):
        for i, (real,) in enumerate(loader):
            netD.zero_grad()
            label = torch.full((real.size(0),), 1.0)
            errD_real = criterion(netD(real), label)
            errD_real.backward()
            noise = torch.randn(real.size(0), nz, 1, 1)
            fake = netG(noise)
            label.fill_(0.0)
            errD_fake = criterion(netD(fake.detach()), label)
            errD_fake.backward()
            applied['D'].append(param_grads(netD))
            optD.step()
            netG.zero_grad()
            label.fill_(1.0)
            errG = criterion(netD(fake), label)
            errG.backward()
            applied['G'].append(param_grads(netG))
            optG.step()
            losses += [(errD_real + errD_fake).item(), errG.item()]
            if it % sample_every == 0:
                with torch.no_grad(): losses.append(netG(fixed_noise).mean().item())
                samples.append(it)
            it += 1
    for te in tes.values():
        if te is not None: te.disarm()
    return dict(losses=losses, state=_state(('D.', netD), ('G.', netG)), iters=it, samples=samples, applied=applied,
                te=tes if armed else None, run=runs if armed else None, db=str(db) if armed else None)


# ---------------------------------------------------------------- word_language_model

class RNNModel(nn.Module):
    "word_language_model's LSTM model: embedding, dropout, LSTM, dropout, decoder; log-probabilities and hidden state."
    def __init__(self, ntoken, ninp=64, nhid=64, nlayers=1, dropout=0.2):
        super().__init__()
        self.ntoken, self.nhid, self.nlayers = ntoken, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias); nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid))

def _repackage(h): return h.detach() if isinstance(h, torch.Tensor) else tuple(_repackage(v) for v in h)

def lstm_lm(armed: bool, tmp_path, seed: int = 0,
            steps: int = 4,            # training batches
            ntoken: int = 16384,       # 16384 x 64: the embedding, decoder and logits are 2**20 elements
            bptt: int = 16, bsz: int = 4, lr: float = 20.0, clip: float = 0.25,
            run: str = 'lstm-lm', **ember) -> dict:
    "word_language_model's loop (SGD by hand), `torch.save(model)`, `torch.load` and an evaluation of the copy."
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4321)
    corpus = torch.randint(ntoken, (bsz, (steps + 2) * bptt + 1), generator=g).t().contiguous()   # batchify's layout
    model = RNNModel(ntoken)
    criterion = nn.NLLLoss()
    db = Path(tmp_path)/'lstm_lm.db'
    te = _arm(armed, model, run, db, ember)
    def get_batch(i): return corpus[i:i + bptt], corpus[i + 1:i + 1 + bptt].reshape(-1)

    model.train()
    losses, hidden = [], model.init_hidden(bsz)
    for b in range(steps):
        data, targets = get_batch(b * bptt)
        model.zero_grad()
        hidden = _repackage(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    path = Path(tmp_path)/f'{run}-{"armed" if armed else "bare"}.pt'
    with open(path, 'wb') as f: torch.save(model, f)
    with open(path, 'rb') as f: reloaded = torch.load(f, weights_only=False)
    reloaded.rnn.flatten_parameters()
    reloaded.eval()
    with torch.no_grad():
        data, targets = get_batch(steps * bptt)
        output, _ = reloaded(data, reloaded.init_hidden(bsz))
        losses.append(criterion(output, targets).item())
    if te is not None: te.disarm()
    with zipfile.ZipFile(path) as z: pickled = b''.join(z.read(n) for n in z.namelist() if n.endswith('.pkl'))
    return dict(losses=losses, state=_state(('', model), ('reloaded.', reloaded)), steps=steps, reloaded=reloaded,
                pickled=pickled,
                te=te, run=run if armed else None, db=str(db) if armed else None)


# ---------------------------------------------------------------- time_sequence_prediction (LBFGS)

class Sequence(nn.Module):
    "time_sequence_prediction's model: two LSTMCells and a Linear unrolled over the input, then `future` steps more."
    def __init__(self, hidden=16):
        super().__init__()
        self.hidden = hidden
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, hidden), nn.LSTMCell(hidden, hidden), nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t, c_t, h_t2, c_t2 = (torch.zeros(input.size(0), self.hidden, dtype=torch.double) for _ in range(4))
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)

def lbfgs(armed: bool, tmp_path, seed: int = 0,
          steps: int = 2,       # optimizer steps
          max_iter: int = 20,   # LBFGS's iterations per step: at most this many closure calls
          length: int = 10, batch: int = 6, future: int = 4,
          run: str = 'lbfgs', **ember) -> dict:
    "time_sequence_prediction's loop; `closure_calls[k]`: how many times optimizer step k called the closure."
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(99)
    x = torch.arange(length + 1, dtype=torch.double) + torch.randint(-4, 5, (batch + 2, 1), generator=g).double()
    data = torch.sin(x / 3.0)
    input, target = data[2:, :-1], data[2:, 1:]
    test_input = data[:2, :-1]
    seq = Sequence().double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=max_iter)
    db = Path(tmp_path)/'lbfgs.db'
    te = _arm(armed, seq, run, db, ember)
    losses, closure_calls = [], []
    for i in range(steps):
        closure_calls.append(0)
        def closure():
            closure_calls[-1] += 1
            optimizer.zero_grad()
            loss = criterion(seq(input), target)
            losses.append(loss.item())
            loss.backward()
            return loss
        optimizer.step(closure)
    with torch.no_grad():                    # the example predicts in train mode: it never calls eval()
        pred = seq(test_input, future=future)
        losses.append(criterion(pred[:, :-future], data[:2, 1:]).item())
    if te is not None: te.disarm()
    return dict(losses=losses, state=_state(('', seq)), opt_steps=steps, closure_calls=closure_calls,
                te=te, run=run if armed else None, db=str(db) if armed else None)


SCRIPTS = dict(nanogpt=nanogpt, dcgan=dcgan, lstm_lm=lstm_lm, lbfgs=lbfgs)
