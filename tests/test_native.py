"The native CPU moments kernel: same stats as torch's kernels on real models, a build shared by processes, a fallback without a compiler."
import copy, os, subprocess, sys, textwrap
import numpy as np
import pytest, torch
from torch import nn
import corpus
from torchember import torchEmber, native

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the native kernel")
STATS = ['numel', 'mean', 'std', 'min', 'max', 'norm', 'zero_frac', 'nan_count', 'inf_count']
KEY = ['module', 'call', 'ttype', 'tname']

def record_one_step(model, args, kwargs, db, run):
    "The rows of one recorded training step of `model`, sorted by key."
    te = torchEmber(model, run=run, db=db)
    torch.manual_seed(0)      # the same dropout masks for both
    corpus.loss_of(model(*args, **kwargs)).backward()
    te.flush()
    df = te.latest().sort_values(KEY).reset_index(drop=True)
    te.disarm()
    return df

def both_kernels(model, args, kwargs, db, monkeypatch):
    "Rows of the same step recorded with the native kernel on and off (a copy of the model each)."
    other = copy.deepcopy(model)
    monkeypatch.setenv('TORCHEMBER_NATIVE', '1')
    a = record_one_step(model, args, kwargs, db, 'native')
    monkeypatch.setenv('TORCHEMBER_NATIVE', '0')
    b = record_one_step(other, args, kwargs, db, 'torch')
    return a, b

def assert_same_stats(a, b):
    assert len(a) == len(b) > 0
    assert a[KEY].equals(b[KEY])
    for c in STATS:
        x, y = a[c].to_numpy(dtype=float), b[c].to_numpy(dtype=float)
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-9, equal_nan=True, err_msg=c)   # without the kernel, large float32 tensors are summed in float32 (cascade sums)

@needs_compiler
@pytest.mark.parametrize('name', sorted(corpus.CORPUS))
def test_native_kernel_records_what_torch_kernels_record(name, db, monkeypatch):
    model, make_batch = corpus.CORPUS[name]()
    args, kwargs = make_batch(0)
    a, b = both_kernels(model, args, kwargs, db, monkeypatch)
    assert_same_stats(a, b)

@needs_compiler
@pytest.mark.parametrize('variant', ['channels_last', 'float64'])
def test_native_kernel_on_channels_last_and_float64_models(variant, db, monkeypatch):
    model, make_batch = corpus.CORPUS['resnet']()
    (x,), kwargs = make_batch(0)
    if variant == 'channels_last': model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    else: model, x = model.double(), x.double()
    a, b = both_kernels(model, (x,), kwargs, db, monkeypatch)
    assert_same_stats(a, b)
    assert set(a.dtype) >= ({'float64'} if variant == 'float64' else {'float32'})

class Blowup(nn.Module):
    "Outputs with NaN and Inf in them, small and large."
    def forward(self, x):
        y = x.clone()
        y[0, 0], y[0, 1] = float('nan'), float('inf')
        return y

@needs_compiler
@pytest.mark.parametrize('width', [8, 70_000])
def test_nan_and_inf_are_counted_whichever_kernel_reads_them(width, db, monkeypatch):
    model = nn.Sequential(nn.Linear(8, width), Blowup(), nn.ReLU())
    x = torch.randn(3, 8)
    a, b = both_kernels(model, (x,), {}, db, monkeypatch)
    assert_same_stats(a, b)
    out = a[(a.module == '1') & (a.ttype == 'output')].iloc[0]
    assert (out.nan_count, out.inf_count) == (1, 1)
    assert np.isnan(out['min']) and np.isnan(out['max'])

def specials_cases(dtype, n):
    "Tensors of `n` elements whose sums are not finite: a causal mask, NaN with Inf, both infinities, all NaN, an overflow."
    nan, inf = float('nan'), float('inf')
    side = int(n ** .5)
    mask = torch.triu(torch.full((side, side), -inf), 1)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    mixed = x.clone(); mixed[::97], mixed[5::89] = nan, inf
    both = x.clone(); both[3], both[-2] = inf, -inf
    cases = [mask, mixed, both, torch.full((n,), nan)]
    cases = [c.to(dtype) for c in cases]
    if dtype == torch.float64:
        big = torch.full((n,), 1e308, dtype=dtype)
        cases += [big, torch.cat([big, torch.tensor([-inf], dtype=dtype)])]
    return cases

@needs_compiler
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('n', [1024, 4 * native.PER_THREAD])
def test_nan_and_inf_are_counted_as_torch_counts_them(dtype, n):
    from torchember.stats import _counted, native_moments
    cases = specials_cases(dtype, n)
    expected = torch.stack([_counted(c) for c in cases]).numpy()
    rows = native.MomentRows()
    for c in cases: rows.take(c)
    for got in (native_moments(cases).numpy(), np.concatenate([native_moments([c]).numpy() for c in cases])):   # a batch; one by one
        np.testing.assert_array_equal(got[:, [0, 3, 4, 5, 6, 7]], expected[:, [0, 3, 4, 5, 6, 7]])   # counts, min and max exactly
        np.testing.assert_array_equal(np.isnan(got[:, 1:3]), np.isnan(expected[:, 1:3]))            # sums: NaN or the same infinity
        np.testing.assert_array_equal(got[:, 1:3][~np.isnan(got[:, 1:3])], expected[:, 1:3][~np.isnan(expected[:, 1:3])])
    m = rows.matrix().numpy()
    np.testing.assert_array_equal(m[:, [0, 3, 4, 5, 6, 7]][:4], expected[:4][:, [0, 3, 4, 5, 6, 7]])   # counted by the kernel itself

@needs_compiler
def test_processes_starting_together_share_one_build(tmp_path):
    cache = tmp_path/'cache'
    code = "from torchember import native; print(native.library()._name)"
    env = {**os.environ, 'TORCHEMBER_CACHE': str(cache)}
    procs = [subprocess.Popen([sys.executable, '-c', code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]   # four imports of torch and a build: 30 s beside 6 busy processes on 2 cores
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1
    assert sorted(p.name for p in cache.iterdir()) == [os.path.basename(paths.pop())]   # no half-written leftovers

def test_without_a_compiler_stats_come_from_torch(tmp_path):
    code = textwrap.dedent('''
        import warnings, torch
        from torchember import native
        from torchember.stats import default_stats
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            assert native.library() is None
        assert any('no native moments kernel' in str(x.message) for x in w), [str(x.message) for x in w]
        s = default_stats(torch.tensor([0., 1., 2., 3.]))
        assert s['mean'].item() == 1.5 and s['zero_frac'].item() == 0.25
        print('ok')
    ''')
    env = {k: v for k, v in os.environ.items() if k != 'CXX'}
    env.update(PATH=str(tmp_path), TORCHEMBER_CACHE=str(tmp_path/'cache'), TORCHEMBER_COMPILE='0', TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stderr

@needs_compiler
@pytest.mark.skipif(not sys.platform.startswith('linux'), reason="reads the process's mapped libraries from /proc")
def test_kernel_threads_are_torchs_own_openmp_workers():
    "Where torch runs on OpenMP the kernel uses that runtime, already loaded, and brings no second copy of one."
    code = textwrap.dedent('''
        import torch
        from torchember import native
        def runtimes(): return sorted({l.split(maxsplit=5)[5].strip() for l in open('/proc/self/maps')
                                       if len(l.split(maxsplit=5)) == 6 and 'omp' in l.split(maxsplit=5)[5].rsplit('/', 1)[-1]})
        before = runtimes()
        x = torch.randn(2**21)
        m = native.moments([x], threads=2)[0]
        assert abs(m[1].item() - x.double().sum().item()) < 1e-6 * x.abs().sum().item()
        print(native.library().openmp, 'parallel backend: OpenMP' in torch.__config__.parallel_info(), before == runtimes())
    ''')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    uses, torch_openmp, same_runtimes = r.stdout.split()
    assert uses == torch_openmp, r.stdout
    assert same_runtimes == 'True'


# ---------------------------------------------------------------- large tensors: the path that measured faster

@needs_compiler
@pytest.mark.parametrize('faster', ['native', 'torch'])
def test_large_tensors_take_the_path_that_measured_faster(tmp_path, monkeypatch, faster):
    "Whatever the CPU, a large tensor goes where the measurement said; the stats are the same either way."
    monkeypatch.setenv('TORCHEMBER_CACHE', str(tmp_path))
    monkeypatch.setattr(native, '_large', {})
    slow, fast = (1.0, 9.0) if faster == 'native' else (9.0, 1.0)
    monkeypatch.setattr(native, 'measure_large', lambda: dict(native=slow, torch=fast, sum=0.5))
    m = native.large_choice()
    gen = torch.Generator().manual_seed(0)
    big, small = torch.randn(native.LARGE, generator=gen), torch.randn(1000, generator=gen)
    assert native.supports(big) == (m['native'] <= m['torch']) == (faster == 'native')
    assert native.supports(small)                       # small tensors always take the kernel
    rows = native.MomentRows()
    assert (rows.take(big) is not None) == (faster == 'native')
    from torchember.stats import default_stats
    s = default_stats(big)
    d = big.double()
    np.testing.assert_allclose([s['norm'].item(), s['max'].item(), s['numel'].item()], [d.norm().item(), d.max().item(), d.numel()],
                               rtol=1e-4)   # torch's path sums in float32: 1.02e-5 off once, on a tensor drawn unseeded
    assert abs(s['mean'].item() - d.mean().item()) < 1e-6

@needs_compiler
def test_large_choice_is_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv('TORCHEMBER_CACHE', str(tmp_path))
    monkeypatch.setattr(native, '_large', {})
    m = native.large_choice()
    assert set(m) == {'native', 'torch', 'sum'} and all(v > 0 for v in m.values())
    kept = list(tmp_path.glob('large-*.json'))
    assert len(kept) == 1
    monkeypatch.setattr(native, '_large', {})
    monkeypatch.setattr(native, 'measure_large', lambda: pytest.fail("measured again"))
    assert native.large_choice() == m                   # read back from the cache, not measured again
