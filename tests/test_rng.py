"Nothing torchember does touches the user's random state: torch's (CPU and CUDA), numpy's and Python's `random`."
import random
import numpy as np
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchember import torchEmber, native

def rng_states()->dict:
    "The global random states a training loop draws from."
    s = dict(torch=torch.random.get_rng_state(), numpy=np.random.get_state(), python=random.getstate())
    if torch.cuda.is_available(): s['cuda'] = torch.cuda.get_rng_state_all()
    return s

def assert_same_states(a:dict, b:dict):
    assert torch.equal(a['torch'], b['torch']), "torch's CPU generator moved"
    (ka, sa, *ra), (kb, sb, *rb) = a['numpy'], b['numpy']
    assert ka == kb and np.array_equal(sa, sb) and ra == rb, "numpy's global generator moved"
    assert a['python'] == b['python'], "Python's random moved"
    if 'cuda' in a: assert all(torch.equal(x, y) for x, y in zip(a['cuda'], b['cuda'])), "a CUDA generator moved"

def seed_all(seed:int=0):
    torch.manual_seed(seed); np.random.seed(seed); random.seed(seed)

@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    "An empty native cache folder, as on a machine's first run: the large-tensor timing (`measure_large`) runs again."
    native.library()                      # the kernel built or loaded from the usual folder first: no rebuild here
    monkeypatch.setenv('TORCHEMBER_CACHE', str(tmp_path/'cache'))
    monkeypatch.setattr(native, '_large', {})

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the native kernel")

@needs_compiler
def test_first_large_tensor_leaves_rng(fresh_cache):
    "The issue's repro: the first tensor of `LARGE` elements met on a fresh cache must not draw from torch's generator."
    def step(armed:bool):
        seed_all()
        m = nn.Linear(1024, 1024)        # its weight has LARGE elements
        te = torchEmber(m, db=':memory:') if armed else None
        m(torch.randn(2, 1024)).sum().backward()
        if te is not None: te.disarm()
        return rng_states()
    assert_same_states(step(armed=True), step(armed=False))
    seed_all()
    before = rng_states()
    native.measure_large(n=2**16, reps=1)
    assert_same_states(rng_states(), before)

def test_hist_sampling_leaves_rng():
    "`hist_stats(sample_n=...)` samples with generators of its own, from a fixed seed: the same sample each run."
    from torchember.instruments import hist_stats
    x = torch.randn(10_000)
    seed_all()
    before = rng_states()
    h = hist_stats(16, sample_n=100)(x)
    assert_same_states(rng_states(), before)
    assert h['hist'].sum().item() == 100
    assert torch.equal(hist_stats(16, sample_n=100)(x)['hist'], h['hist'])

def train(armed:bool, db:str, device:str='cpu', steps:int=5)->tuple:
    "Losses of a few SGD steps of a model with dropout, on shuffled batches; the random states after them."
    seed_all()
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.5), nn.Linear(1024, 4)).to(device)
    data = TensorDataset(torch.randn(24, 1024), torch.randn(24, 4))
    dl = DataLoader(data, batch_size=8, shuffle=True)   # 3 batches an epoch: the second epoch's order is drawn mid-run
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    te = None
    if armed: te = torchEmber(model, db=db, hist=16, sample_n=1000, timing=True, io_grad=True, track_updates=True,
                              snapshot='*.weight', snapshot_fn=lambda w: w[:2])   # 2 rows: 4 MB saved a step is slow
    losses = []
    while len(losses) < steps:
        for xb, yb in dl:
            if len(losses) == steps: break
            loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
            if te is not None: te.log(loss=loss)
    if te is not None: te.disarm()
    return losses, rng_states()

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='no GPU')

@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=needs_gpu)])
def test_training_with_every_instrument_leaves_rng(fresh_cache, tmp_path, device):
    "Armed with every instrument, a run trains bit for bit as the bare one and leaves every random state as it would."
    armed_losses, armed_states = train(True, str(tmp_path/'s.db'), device)
    bare_losses, bare_states = train(False, None, device)
    assert armed_losses == bare_losses
    assert_same_states(armed_states, bare_states)


def test_pca_picture_of_a_large_tensor_leaves_rng():
    "The explorer's PCA of a large snapshot is randomized on a generator of its own: the global seed and state stay the user's."
    from torchember.figures import tensor_figure
    torch.manual_seed(42)
    x = torch.randn(300, 300)
    state = torch.random.get_rng_state()
    tensor_figure(x, kind='pca')
    assert torch.initial_seed() == 42
    assert torch.equal(torch.random.get_rng_state(), state)
