"What the speed design promises and a test can check without timing anything."
import gc, os, sys, threading, warnings, weakref
import pytest, torch
from torch import nn
from torchember import torchEmber

def mlp(): return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))

def test_no_tensor_of_the_model_kept_after_the_step(db):
    model = mlp()
    te = torchEmber(model, run='retain', db=db)
    refs = []
    hooks = [m.register_forward_hook(lambda m, a, o: refs.append(weakref.ref(o))) for m in model.modules()]
    x = torch.randn(4, 8)
    model(x).sum().backward()
    grads = [weakref.ref(p.grad) for p in model.parameters()]
    for h in hooks: h.remove()
    for p in model.parameters(): p.grad = None
    te.flush()
    gc.collect()
    assert refs and all(r() is None for r in refs), "an output of the recorded step is still alive"
    assert all(r() is None for r in grads), "a grad of the recorded step is still alive"
    assert len(te.latest()) > 0
    te.disarm()

def test_unrecorded_steps_do_no_work(db):
    model = mlp()
    calls = []
    te = torchEmber(model, run='every', db=db, every=5)
    def counting(t):
        calls.append(1)
        return {'n': t.numel()}
    for tt in ('input', 'output', 'weight', 'weight_grad'): te.how_record(tt, counting)
    model(torch.randn(2, 8)).sum().backward()          # step 0: recorded
    n0 = len(calls)
    assert n0 > 0
    for _ in range(4):                                 # steps 1-4: not recorded
        model(torch.randn(2, 8)).sum().backward()
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in list(model.modules())[1:])
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert len(calls) == n0, "a stat function ran on an unrecorded step"
    model(torch.randn(2, 8)).sum().backward()          # step 5: recorded again
    assert len(calls) == 2 * n0
    assert sorted(te.df().step.unique()) == [0, 5]
    te.disarm()

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: no CUDA device here")
def test_at_most_one_sync_per_recorded_step_on_gpu(db):
    model = mlp().cuda()
    te = torchEmber(model, run='gpu', db=db, every=2)
    x = torch.randn(4, 8, device='cuda')
    for _ in range(3): model(x).sum().backward()      # warm up (compiles kernels)
    te.flush()
    torch.cuda.set_sync_debug_mode('error')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        try:
            model(x).sum().backward()                 # step 3: not recorded, must not sync at all
            model(x).sum().backward()                 # step 4: recorded; its close happens at the next root call
            model(x).sum().backward()
        finally: torch.cuda.set_sync_debug_mode(0)
    te.flush()
    assert not [str(m.message) for m in w if 'torchember' in str(m.message)], [str(m.message) for m in w]
    df = te.df()
    assert 4 in set(df.step) and df[df.step == 4]['mean'].notna().all(), df   # a sync inside the step's gather empties its stats
    te.disarm()

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: no CUDA device here")
def test_cuda_graph_capture_of_an_armed_model(db):
    "A whole step captured in a CUDA graph (as torch's docs show it) and replayed: the capture works, nothing is recorded in it."
    torch.manual_seed(0)
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, device='cuda')
    te = torchEmber(model, run='graph', db=db)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up on a side stream: recorded, steps 0-2
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match='CUDA graph is being captured'):
        with torch.cuda.graph(g):
            loss = model(x).sum()
            loss.backward()
            opt.step()
    for _ in range(3): g.replay()                     # no hooks run: not recorded
    torch.cuda.synchronize()
    model(x).sum().backward()                         # eager again: step 3
    te.flush()
    df = te.df()
    assert sorted(df.step.unique()) == [0, 1, 2, 3] and df['mean'].notna().all(), df
    assert torch.isfinite(loss).item()
    te.disarm()

def _policy(tid): return open(f'/proc/self/task/{tid}/sched').read().split('policy')[1].split(':')[1].split()[0]

@pytest.mark.skipif(sys.platform != 'linux', reason="scheduling policies are Linux's")
def test_writer_runs_at_normal_priority(db):
    "The writer thread is SCHED_OTHER (0), not SCHED_IDLE: an idle-only thread can wait for seconds where training keeps every core busy, past the time bound on what a kill loses; the training thread keeps its policy."
    model = mlp()
    te = torchEmber(model, run='idle', db=db)
    before = _policy(threading.get_native_id())
    model(torch.randn(2, 8)).sum().backward()
    te.flush()
    assert _policy(te.writer._t.native_id) == str(os.SCHED_OTHER)
    assert _policy(threading.get_native_id()) == before
    assert len(te.latest()) > 0
    te.disarm()
