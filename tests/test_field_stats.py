"Issue 17, stats: nothing the stats compute raises into the user's forward or backward; bounded and named custom stats; no leaked file."
import gc, os, subprocess, sys, textwrap, time, warnings
import pytest, torch
from torch import nn
from torchember import torchEmber, native, stats


def tw(rec):
    "The torchember warnings among `rec` (a `catch_warnings(record=True)` list)."
    return [str(w.message) for w in rec if str(w.message).startswith('torchember')]

def model_of(dtype):
    "Small layers (stacked by size) and a large one (over `stats.SMALL` elements, read on its own), in `dtype`."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 4)).to(dtype)

def one_step(model, dtype, **kw):
    "Arm `model`, train it one step, flush; the recorded rows and the torchember warnings."
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(model, **kw)
        model(torch.randn(3, 8, dtype=dtype)).float().pow(2).mean().backward()
        te.flush()
        df = te.latest()
        te.disarm()
    return df, tw(rec)

def raising(*args, **kwargs): raise AssertionError("Artifact of type=inductor already registered")

@pytest.fixture
def fresh_kernels(monkeypatch):
    "No stats kernel compiled yet in this process, and compiling asked for (`TORCHEMBER_COMPILE=1`)."
    monkeypatch.setattr(stats, '_compiled', {})
    monkeypatch.setenv('TORCHEMBER_COMPILE', '1')
    if hasattr(stats, '_COMPILE'): monkeypatch.setattr(stats, '_COMPILE', dict(stats._COMPILE))


# ---------------------------------------------------------------- item 2: compiling never reaches the user's backward

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('how', ['compile raises', 'compiled function raises'])
def test_failing_compile_never_reaches_backward(how, dtype, db, fresh_kernels, monkeypatch):
    "With no native kernel (`TORCHEMBER_NATIVE=0`) and `torch.compile` broken, a bf16/fp16/fp32 model trains and is recorded."
    monkeypatch.setenv('TORCHEMBER_NATIVE', '0')
    monkeypatch.setattr(torch, 'compile', raising if how == 'compile raises' else lambda fn, **kw: raising)
    df, warned = one_step(model_of(dtype), dtype, db=db)
    w = df[df.ttype.isin(['weight', 'weight_grad'])]
    assert len(w) == 12 and w['mean'].notna().all() and w['norm'].gt(0).all(), df
    assert len(warned) <= 1 and all('eager' in m for m in warned), warned

def test_stats_on_a_cpu_compile_nothing(db, fresh_kernels, monkeypatch):
    "On a CPU the stats use no compiled code, whatever the dtype and with or without the native kernel: no first-step compile to wait for."
    calls = []
    monkeypatch.setattr(torch, 'compile', lambda fn, **kw: calls.append(fn) or fn)
    for nat in '10':
        monkeypatch.setenv('TORCHEMBER_NATIVE', nat)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            df, warned = one_step(model_of(dtype), dtype, db=db, run=f'{nat}-{dtype}')
            assert df['mean'].notna().all() and not warned, warned
    x = torch.tensor([[1., float('nan'), 3.], [4., 5., float('inf')]])
    assert stats.moments(x)[:, 6:].tolist() == [[1, 0], [0, 1]]
    assert calls == []

def test_accelerator_kernels_fall_back_to_eager_with_one_warning(fresh_kernels, monkeypatch):
    "The compiled kernels of accelerators: when `torch.compile` raises, or the compiled code does, eager kernels give the same moments, with one warning."
    x, rows = torch.randn(1000), torch.randn(4, 50)
    want_flat, want_rows = stats._kernel('flat', False)(x), stats._kernel('rows', False)(rows)
    for broken in (raising, lambda fn, **kw: raising):
        monkeypatch.setattr(stats, '_compiled', {})
        monkeypatch.setattr(torch, 'compile', broken)
        if hasattr(stats, '_COMPILE'): monkeypatch.setattr(stats, '_COMPILE', {})
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter('always')
            for _ in range(2):
                torch.testing.assert_close(stats._kernel('flat', False)(x), want_flat)
                torch.testing.assert_close(stats._kernel('rows', False)(rows), want_rows)
        warned = tw(rec)
        assert len(warned) == 1 and 'eager' in warned[0] and 'Artifact' in warned[0], warned
    assert os.environ.get('TORCHEMBER_COMPILE') == '1'   # the user's environment is left alone

def test_no_compiler_and_no_writable_folder(tmp_path):
    "No C++ compiler on the PATH, no writable temp or cache folder: a bf16 and a float32 model train, armed, and are recorded."
    ro = tmp_path/'ro'
    ro.mkdir()
    ro.chmod(0o500)
    code = textwrap.dedent(f'''
        import warnings, torch
        from torch import nn
        from torchember import torchEmber
        warnings.simplefilter('always')
        for dt in (torch.bfloat16, torch.float32):
            m = nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 300)).to(dt)
            te = torchEmber(m, db={str(tmp_path/'s.db')!r}, run=str(dt))
            m(torch.randn(3, 8, dtype=dt)).float().sum().backward()
            te.flush()
            df = te.latest()
            te.disarm()
            assert df['mean'].notna().all(), df
        print('ok')
    ''')
    env = {k: v for k, v in os.environ.items() if k not in ('CXX', 'TORCHEMBER_COMPILE', 'TORCHEMBER_NATIVE')}
    env.update(PATH=str(ro), TORCHEMBER_CACHE=str(ro/'cache'), TMPDIR=str(ro), HOME=str(ro), XDG_CACHE_HOME=str(ro),
               TORCHINDUCTOR_CACHE_DIR=str(ro/'inductor'))
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stderr[-3000:]
    assert r.stderr.count('Warning') <= 2, r.stderr[-3000:]   # no native kernel; nothing more


# ---------------------------------------------------------------- item 2, siblings: every step of the recorder is guarded

def _fail(*args, **kwargs): raise RuntimeError("injected")

INTERNALS = {'moments': (stats, 'moments'), 'native_moments': (stats, 'native_moments'), '_plan': (stats, '_plan'),
             '_to_host': (stats, '_to_host'), 'Batch.__call__': (native.Batch, '__call__'),
             'MomentRows.take': (native.MomentRows, 'take'), 'fused_moments': (stats, 'fused_moments')}
REACHED = [('moments', '0'), ('fused_moments', '0'), ('_plan', '0'), ('_plan', '1'), ('_to_host', '0'), ('_to_host', '1'),
           ('native_moments', '1'), ('Batch.__call__', '1'), ('MomentRows.take', '1')]   # (internal, TORCHEMBER_NATIVE) where a step calls it

@pytest.mark.parametrize('where,native_on', REACHED)
def test_a_failing_internal_never_reaches_the_user(where, native_on, db, monkeypatch):
    "Whatever part of the recorder raises, the step trains and is recorded (its stats left empty where they could not be computed), with a warning; with `strict=True` it raises."
    monkeypatch.setenv('TORCHEMBER_NATIVE', native_on)
    monkeypatch.setattr(*INTERNALS[where], _fail)
    monkeypatch.setattr(stats, '_PLANS', {})       # no plan cached by an earlier test
    model = model_of(torch.float32)
    df, warned = one_step(model, torch.float32, db=db, run='lenient')
    assert set(df.ttype) >= {'input', 'output', 'weight', 'weight_grad'} and len(df) == 24, df
    with pytest.raises(RuntimeError, match='injected'):
        one_step(model, torch.float32, db=db, run='strict', strict=True)

def test_a_failing_update_tracker_is_a_warning(db, monkeypatch):
    "The weights' extra stats (`track_updates`) failing cost their values, not the step."
    from torchember import instruments
    monkeypatch.setattr(instruments.UpdateTracker, '__call__', _fail)
    df, warned = one_step(model_of(torch.float32), torch.float32, db=db, track_updates=True)
    assert len(df[df.ttype == 'weight']) == 6 and df['mean'].notna().all()
    assert len(warned) == 1 and 'injected' in warned[0], warned

def test_custom_values_on_two_devices_reach_the_host(db):
    "Custom stats returning tensors on two devices are gathered to the host without a device error."
    if not torch.cuda.is_available(): pytest.skip("needs a second device")
    def two(t): return {'a': torch.ones(2), 'b': torch.ones(2, device='cuda')}
    m = model_of(torch.float32)
    te = torchEmber(m, db=db)
    te.how_record_out(two)
    m(torch.randn(3, 8)).sum().backward()
    te.flush()
    got = te.latest().query("ttype == 'output'")
    assert len(got) and got[['a', 'b']].notna().all().all(), got   # each custom stat is a column of its own


# ---------------------------------------------------------------- item 16: bounded vector stats, a dominating stat function named

def test_a_vector_stat_over_the_bound_is_refused_with_one_warning(db):
    "A stat of more than `stats.VECTOR_MAX` values is not stored: one warning names the function, module, tensor and bound."
    def huge(t): return {'many': torch.zeros(10**6), 'few': torch.zeros(4)}
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(model, db=db)
        te.how_record_out(huge)
        for _ in range(3): model(torch.randn(2, 4)).sum().backward()
        te.flush()
        df = te.latest()
        te.disarm()
    warned = [m for m in tw(rec) if 'huge' in m]
    assert len(warned) == 2, warned            # one per module and tensor, once over the steps
    assert all(str(stats.VECTOR_MAX) in m and 'many' in m and "'output'" in m for m in warned), warned
    assert any("module '0'" in m for m in warned) and any("module '1'" in m for m in warned)
    assert stats.VECTOR_MAX == 4096
    assert 'many' not in df.columns
    assert len(df[df.ttype == 'output']) == 3
    assert stats.check_stats({'ok': torch.zeros(stats.VECTOR_MAX), 'l': [0.] * stats.VECTOR_MAX})['l'] == [0.] * 4096
    with pytest.raises(ValueError, match='4096'): stats.check_stats({'l': [0.] * (stats.VECTOR_MAX + 1)}, 'f')

def test_a_stat_function_that_dominates_the_step_is_named_once(db):
    "A custom stat function taking most of a step's time (and over `stats.SLOW_S` seconds in it) is named once, with its time and the step's."
    def slow(t):
        time.sleep(0.06)
        return {'absmax': t.abs().max()}
    def quick(t): return {'absmax': t.abs().max()}
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(model, db=db)
        te.how_record_out(slow)
        te.how_record_in(quick)
        for _ in range(3): model(torch.randn(2, 4)).sum().backward()
        te.flush()
        te.disarm()
    warned = [m for m in tw(rec) if 'slow' in m]
    assert len(warned) == 1 and 'quick' not in ''.join(tw(rec)), tw(rec)
    assert "'slow'" in warned[0] and '% of' in warned[0] and ' s ' in warned[0], warned

class Interrupt(nn.Module):
    "Ctrl-C in the middle of a forward."
    def forward(self, x): raise KeyboardInterrupt

def test_a_step_cut_short_is_not_judged_slow(db):
    "A Ctrl-C cuts a step short after a slow stat function ran in it: closing that step says nothing of slowness."
    def slow(t):
        time.sleep(0.25)
        return {'absmax': t.abs().max()}
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), Interrupt())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        te = torchEmber(model, db=db)
        te.how_record_out(slow)
        for _ in range(2):   # the first call of a stat function is not counted
            with pytest.raises(KeyboardInterrupt): model(torch.randn(2, 4))
        te.flush()
        te.disarm()
    assert not [m for m in tw(rec) if 'slow' in m], tw(rec)

def test_a_stat_function_slow_only_on_its_first_call_is_not_named(db):
    "A first call that warms up (an import, a kernel's first run) takes most of one step: no warning for that alone."
    calls = []
    def warms_up(t):
        if not calls: time.sleep(0.3)
        calls.append(1)
        return {'absmax': t.abs().max()}
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        with torchEmber(model, db=db) as te:
            te.how_record_out(warms_up)
            for _ in range(4): model(torch.randn(2, 4)).sum().backward()
    assert len(calls) > 4 and not [m for m in tw(rec) if 'warms_up' in m], tw(rec)

def test_default_stats_are_not_timed(db, monkeypatch):
    "The default stats pay no timing cost: `time.perf_counter` is not called per tensor."
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    te = torchEmber(model, db=db)
    model(torch.randn(2, 4)).sum().backward()
    n = []
    real = time.perf_counter
    monkeypatch.setattr(stats.time, 'perf_counter', lambda: n.append(1) or real())
    for _ in range(3): model(torch.randn(2, 4)).sum().backward()
    monkeypatch.undo()
    te.disarm()
    assert len(n) <= 3 * 2, len(n)      # at most a step's start and end


# ---------------------------------------------------------------- item 17: no file left open

@pytest.mark.skipif(not sys.platform.startswith('linux'), reason="reads /proc/self/maps")
def test_openmp_runtime_closes_what_it_reads():
    "`native.openmp_runtime` leaves no file open (no ResourceWarning)."
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        native.openmp_runtime()
        gc.collect()
    assert not [w for w in rec if issubclass(w.category, ResourceWarning)], [str(w.message) for w in rec]
