"""Model corpus for torchember's tests and benchmark: small pure-torch models that exercise awkward cases.

Every factory seeds torch itself (so two calls give identical weights) and returns `(model, make_batch)`, where
`make_batch(seed)` returns `(args, kwargs)` for `model(*args, **kwargs)`, built from a private `torch.Generator`
(the global RNG is left alone). `loss_of(output)` turns any output (tensor, tuple, list, dict, namedtuple) into a
scalar to call `.backward()` on.

Cases covered: in-place ReLUs and an in-place residual add (`out += identity`), one ReLU module called twice per
block, BatchNorm buffers, tuple outputs from an inner module (LSTM's `(output, (h, c))`), kwargs-only forward
arguments (`src_key_padding_mask`, `scale=`, `extra=`), dict and namedtuple outputs, a submodule called twice per
forward, and many tiny modules (`mlp32`).

`CORPUS` maps names to zero-argument factories of the small test models; `BENCH` does the same for the
benchmark-size models (ResNet-18 at 8x3x32x32, the 32-layer MLP at 32x64, full AlexNet at 2x3x224x224).
"""
from collections import namedtuple
from functools import partial

import torch
import torch.nn as nn

__all__ = ['loss_of', 'alexnet_like', 'resnet_like', 'lstm_model', 'transformer_model', 'kwargs_dict_model',
           'namedtuple_model', 'shared_twice_model', 'mlp32', 'CORPUS', 'BENCH',
           'AlexNetLike', 'BasicBlock', 'ResNetLike', 'LSTMModel', 'TransformerModel', 'KwargsDictModel',
           'NamedTupleModel', 'SharedTwiceModel', 'ModelOutput', 'GPTBlock', 'GPTLike', 'gpt_like']


def _float_tensors(obj):
    "Yield every tensor nested in `obj` (tensor, tuple/list/namedtuple, dict)."
    if isinstance(obj, torch.Tensor): yield obj
    elif isinstance(obj, dict):
        for v in obj.values(): yield from _float_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj: yield from _float_tensors(v)


def loss_of(output) -> torch.Tensor:
    "Scalar loss: sum of `.float().mean()` over every float tensor in `output` that requires grad."
    terms = [t.float().mean() for t in _float_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms: raise ValueError(f"loss_of: no float tensor requiring grad in output of type {type(output).__name__}")
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def train_step(model, batch, seed):
    "One forward of `batch` (`(args, kwargs)`, as the factories make them) with the RNG at `seed`, and the backward of `loss_of`."
    args, kwargs = batch
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    loss_of(out).backward()
    return out


def _gen(seed: int) -> torch.Generator: return torch.Generator().manual_seed(int(seed))


# ---------------------------------------------------------------- AlexNet

class AlexNetLike(nn.Module):
    "AlexNet layout (as torchvision's): 5 convs + ReLU(inplace) + 3 maxpools, AdaptiveAvgPool2d, Flatten, Dropout, 3 Linear."
    def __init__(self, widths=(64, 192, 384, 256, 256), hidden=4096, num_classes=1000, dropout=0.5):
        super().__init__()
        c1, c2, c3, c4, c5 = widths
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(c5 * 6 * 6, hidden), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes))

    def forward(self, x): return self.classifier(self.flatten(self.avgpool(self.features(x))))


def alexnet_like(small: bool = True, batch: int = 2):
    "AlexNet. `small`: widths /4, hidden 256, 10 classes, input `batch`x3x64x64; else real sizes (61.1M params), `batch`x3x224x224."
    torch.manual_seed(0)
    if small: model, size = AlexNetLike((16, 48, 96, 64, 64), hidden=256, num_classes=10), 64
    else:     model, size = AlexNetLike(), 224
    def make_batch(seed: int): return (torch.randn(batch, 3, size, size, generator=_gen(seed)),), {}
    return model, make_batch


# ---------------------------------------------------------------- ResNet

class BasicBlock(nn.Module):
    "ResNet BasicBlock as torchvision's: one `relu` module called twice, in-place residual add `out += identity`."
    expansion = 1
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


_RESNET_LAYERS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}

class ResNetLike(nn.Module):
    "CIFAR-style ResNet (3x3 stem, no maxpool) for 32x32 inputs: conv1/bn1/relu, layer1..layer4, avgpool, flatten, fc."
    def __init__(self, layers=(2, 2, 2, 2), width=64, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        cin, stages = width, []
        for i, n in enumerate(layers):
            cout, stride = width * 2**i, (1 if i == 0 else 2)
            blocks = [BasicBlock(cin, cout, stride)] + [BasicBlock(cout, cout) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks)); cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))


def resnet_like(depth: int = 18, tiny: bool = False, batch: int = 8):
    "ResNet-`depth` (10, 18 or 34) with BasicBlocks for `batch`x3x32x32. `tiny`: width 8 instead of 64 (for tests)."
    if depth not in _RESNET_LAYERS: raise ValueError(f"depth must be one of {sorted(_RESNET_LAYERS)}")
    torch.manual_seed(0)
    model = ResNetLike(_RESNET_LAYERS[depth], width=8 if tiny else 64)
    def make_batch(seed: int): return (torch.randn(batch, 3, 32, 32, generator=_gen(seed)),), {}
    return model, make_batch


# ---------------------------------------------------------------- LSTM

class LSTMModel(nn.Module):
    "Embedding -> 2-layer batch_first LSTM (returns `(output, (h, c))`) -> Linear head on the last time step."
    def __init__(self, vocab=50, emb=16, hidden=32, num_classes=5):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens):
        out, (h, c) = self.lstm(self.embedding(tokens))
        return self.head(out[:, -1])


def lstm_model(batch: int = 4, seq: int = 12):
    "`LSTMModel`; batch: int64 tokens `batch`x`seq` in [0, 50)."
    torch.manual_seed(0)
    model = LSTMModel()
    def make_batch(seed: int): return (torch.randint(0, 50, (batch, seq), generator=_gen(seed)),), {}
    return model, make_batch


# ---------------------------------------------------------------- Transformer

class TransformerModel(nn.Module):
    "`nn.TransformerEncoder` (2 layers, d_model 32, nhead 4, dropout 0, batch_first) + Linear head; mask is a kwarg."
    def __init__(self, d_model=32, nhead=4, num_layers=2, num_classes=5):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x, src_key_padding_mask=None):
        h = self.encoder(x, src_key_padding_mask=src_key_padding_mask)
        return self.head(h[:, 0])


def transformer_model(batch: int = 4, seq: int = 10):
    "`TransformerModel`; batch: x `batch`x`seq`x32, kwarg `src_key_padding_mask` (bool, True = padding, the tail of each row)."
    torch.manual_seed(0)
    model = TransformerModel()
    def make_batch(seed: int):
        g = _gen(seed)
        x = torch.randn(batch, seq, 32, generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
        mask = torch.arange(seq)[None, :] >= lengths[:, None]
        return (x,), {'src_key_padding_mask': mask}
    return model, make_batch


# ---------------------------------------------------------------- kwargs in, dict / namedtuple out

ModelOutput = namedtuple('ModelOutput', ['logits', 'hidden'])

class KwargsDictModel(nn.Module):
    "forward(x, *, scale=1.0, extra=None) -> {'logits': ..., 'hidden': ...}."
    def __init__(self, d_in=16, d_hidden=24, num_classes=4):
        super().__init__()
        self.proj = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.head = nn.Linear(d_hidden, num_classes)

    def _hidden(self, x, scale, extra):
        h = self.act(self.proj(x)) * scale
        return h if extra is None else h + extra

    def forward(self, x, *, scale=1.0, extra=None):
        h = self._hidden(x, scale, extra)
        return {'logits': self.head(h), 'hidden': h}


class NamedTupleModel(KwargsDictModel):
    "As `KwargsDictModel` but returns `ModelOutput(logits, hidden)`, a namedtuple."
    def forward(self, x, *, scale=1.0, extra=None):
        h = self._hidden(x, scale, extra)
        return ModelOutput(self.head(h), h)


def _kwargs_batch(batch):
    def make_batch(seed: int):
        g = _gen(seed)
        return (torch.randn(batch, 16, generator=g),), {'scale': 0.5, 'extra': torch.randn(batch, 24, generator=g)}
    return make_batch

def kwargs_dict_model(batch: int = 6):
    "`KwargsDictModel`; batch: x `batch`x16, kwargs `scale=0.5`, `extra` (`batch`x24 tensor)."
    torch.manual_seed(0)
    return KwargsDictModel(), _kwargs_batch(batch)

def namedtuple_model(batch: int = 6):
    "`NamedTupleModel`; same batch as `kwargs_dict_model`."
    torch.manual_seed(0)
    return NamedTupleModel(), _kwargs_batch(batch)


# ---------------------------------------------------------------- shared submodule

class SharedTwiceModel(nn.Module):
    "Calls `self.block` twice per forward: `head(block(block(x)))`."
    def __init__(self, d=16, num_classes=3):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, num_classes)

    def forward(self, x): return self.head(self.block(self.block(x)))


def shared_twice_model(batch: int = 5):
    "`SharedTwiceModel`; batch: x `batch`x16."
    torch.manual_seed(0)
    model = SharedTwiceModel()
    def make_batch(seed: int): return (torch.randn(batch, 16, generator=_gen(seed)),), {}
    return model, make_batch


# ---------------------------------------------------------------- many tiny modules

def mlp32(batch: int = 32, depth: int = 32, width: int = 64):
    "`nn.Sequential` of `depth` x (Linear(`width`, `width`), GELU()); batch: x `batch`x`width`. Benchmark worst case."
    torch.manual_seed(0)
    layers = []
    for _ in range(depth): layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers)
    def make_batch(seed: int): return (torch.randn(batch, width, generator=_gen(seed)),), {}
    return model, make_batch


CORPUS = {
    'alexnet': partial(alexnet_like, small=True),
    'resnet': partial(resnet_like, depth=18, tiny=True),
    'lstm': lstm_model,
    'transformer': transformer_model,
    'kwargs_dict': kwargs_dict_model,
    'namedtuple': namedtuple_model,
    'shared_twice': shared_twice_model,
}
"Name -> zero-argument factory returning `(model, make_batch)`, for the small test models."

class Wrapped(nn.Module):
    "A model class of the user's around `body`: `torch.compile` of it runs its root hooks outside the compiled graph."
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
    def forward(self, x): return self.body(x)

_REGIONS = {}   # a module class -> the block class whose forward, a nested compile region, calls one of them

def _region_block(kind: type) -> type:
    "A block class calling one `kind` module in a nested compile region: a region function of its own per kind."
    # torch reuses a region's body for any call with the same function and inputs alike; one block class for every
    # kind made a parameterless Dropout's region run the ReLU's body (torch 2.13), a wrong bare model
    if kind not in _REGIONS:
        @torch.compiler.nested_compile_region
        def forward(self, x): return self.inner(x)
        def __init__(self, inner):
            nn.Module.__init__(self)
            self.inner = inner
        _REGIONS[kind] = type(f'{kind.__name__}Region', (nn.Module,), dict(__init__=__init__, forward=forward))
    return _REGIONS[kind]

def regioned(body: nn.Sequential) -> nn.Sequential:
    "`body` with each child called in a nested compile region, as the blocks of a model of regions are."
    return nn.Sequential(*[_region_block(type(m))(m) for m in body])


class GPTBlock(nn.Module):
    "A GPT-2 block: pre-norm causal self-attention and a 4x GELU MLP."
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTLike(nn.Module):
    "A GPT-2-shaped decoder built from its sizes (no download)."
    def __init__(self, layers=12, d=768, heads=12, vocab=50257, seq=512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer('mask', torch.triu(torch.full((seq, seq), float('-inf')), 1), persistent=False)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        for b in self.blocks: x = b(x, self.mask[:n, :n])
        return self.head(self.ln(x))


def gpt_like(layers: int = 12, d: int = 256, heads: int = 4, vocab: int = 4096, seq: int = 128, batch: int = 4):
    "GPT-2's layout at CPU size: by default 12 layers 256 wide, 4 heads, 128 tokens of a 4,096-token vocabulary, batch 4."
    torch.manual_seed(0)
    model = GPTLike(layers, d, heads, vocab, seq)
    def make_batch(seed: int): return (torch.randint(0, vocab, (batch, seq), generator=_gen(seed)),), {}
    return model, make_batch


BENCH = {
    'resnet18': partial(resnet_like, depth=18, tiny=False, batch=8),
    'mlp32': mlp32,
    'alexnet': partial(alexnet_like, small=False, batch=2),
    'gpt2': gpt_like,
}
"Name -> zero-argument factory for the benchmark-size models."
