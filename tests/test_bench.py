"The benchmark runs and reports every configuration and every part (its figures are not checked: they are timings)."
import importlib.util, os, re, subprocess, sys
import pytest
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent/'bench'/'bench.py'

def _run(*args):
    r = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout

def test_ratios_of_both_configurations():
    out = _run('--quick', '--models', 'mlp32', '--blocks', '1', '--steps', '10', '--warmup', '1', '--no-store')
    rows = [l.split() for l in out.splitlines() if l.startswith('mlp32')]
    assert [r[1:3] for r in rows] == [['torchEmber', '10'], ['torchEmber', 'every=10']]
    ratios = [[float(t[:-1]) for t in r if t.endswith('x')] for r in rows]   # floor, ratio, paired
    assert all(len(x) == 3 and x[1] > 0 and x[2] > 0 for x in ratios)
    assert all(x[0] >= 1 for x in ratios)          # the floor: one read of the params and grads (the ratio may be under 1: noise)
    us, writer, here, n, first = zip(*[map(float, r[-5:]) for r in rows])   # per tensor: training thread, writer, its in-process part; ...
    assert all(w > 0 for w in writer) and n[0] > 200 and n[1] < n[0] / 5, (writer, n)   # every step: 258 tensors; every=10: a tenth
    assert all(0 < h <= w for h, w in zip(here, writer)), (here, writer)                 # the writer thread's part of the writer's CPU
    assert all(f > 0 for f in first), first          # a run's first step, timed apart before the clock
    machine = next(l for l in out.splitlines() if l.startswith('machine: '))
    assert 'cores' in machine and ' L' in machine, machine   # names the CPU, its cores and caches

def test_machine_names_the_cpu_it_runs_on():
    m = _bench().machine()
    assert m['cpu'] and m['cores'] >= 1
    flags = open('/proc/cpuinfo').read() if Path('/proc/cpuinfo').exists() else ''
    assert ('AVX2' in m['vector']) == (' avx2' in flags)
    assert ('AVX-512' in m['vector']) == (' avx512f' in flags)

def test_breakdown_switches_each_part_off():
    out = _run('--breakdown', '--quick', '--blocks', '1', '--cycles', '2')
    for variant in ('armed', 'no writer', 'no activation stats', 'no weight/grad stats', 'empty hooks'):
        assert any(l.startswith(variant + ' ') for l in out.splitlines()), variant
    parts = [l for l in out.splitlines() if l.rstrip().endswith(' ms') and l.startswith('  ')]
    assert len(parts) == 5, out

def _bench():
    if str(BENCH.parent) not in sys.path: sys.path.insert(0, str(BENCH.parent))
    import bench
    return bench

def test_switching_off_a_method_that_is_not_there_fails():
    class Recorder: pass
    with pytest.raises(AttributeError, match='emit'): _bench()._off(Recorder(), 'emit')

@pytest.mark.parametrize('switch, ttypes', [(None, {'input', 'output', 'weight', 'weight_grad'}), ('_no_writer', set()),
    ('_no_activations', {'weight', 'weight_grad'}), ('_no_params', {'input', 'output'}), ('_empty_hooks', {'weight', 'weight_grad'})])
def test_each_switch_leaves_out_what_it_names(tmp_path, switch, ttypes):
    import torch
    from torchember import torchEmber
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 1))
    te = torchEmber(model, run='r', db=tmp_path/'s.db')
    if switch: getattr(_bench(), switch)(te)
    for _ in range(2): model(torch.randn(3, 4)).sum().backward()
    te.flush()
    df = te.df()
    assert set(df.ttype) == ttypes
    te.disarm()

GPU = Path(__file__).resolve().parent.parent/'bench'/'gpu.py'

def test_gpu_benchmark_runs_as_is():
    "The GPU benchmark's script runs end to end (on the CPU, tiny models, where no GPU is lent); its figures are not checked."
    r = subprocess.run([sys.executable, str(GPU), '--device', 'cpu', '--tiny', '--blocks', '1', '--steps', '10'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith(('gpt2-small', 'resnet18-b256'))]
    assert [r[:2] for r in rows if r[1].startswith('every=')] == [['gpt2-small', 'every=1'], ['gpt2-small', 'every=10'],
                                                                  ['resnet18-b256', 'every=1'], ['resnet18-b256', 'every=10']]
    assert [r[0] for r in rows if "first recorded step" in ' '.join(r)] == ['gpt2-small', 'resnet18-b256'], r.stdout

def test_gpu_proxy_benchmark_runs_as_is():
    "The script that times the GPU path's host side on a CPU runs end to end; its figures are not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'gpu_proxy.py'), '--layers', '2', '--rounds', '1', '--steps', '3'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training thread's CPU a step: bare" in r.stdout and 'training  Recorder._planned' in r.stdout, r.stdout

def test_gpu_threads_benchmark_runs_as_is():
    "The script that splits an armed GPU step's time by thread runs end to end on the CPU (tiny model); figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'gpu_threads.py'), '--device', 'cpu', '--tiny', '--rounds', '1',
                        '--steps', '4', '--models', 'gpt2-small', '--parts'], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for v in ('bare', 'armed', 'writer only at flush', 'no writer', 'nothing but module hooks'): assert f'  {v} ' in out, out
    assert 'training  Capture._grads_done' in out and 'writer    Writer._put' in out, out

def test_gpu_steps_benchmark_runs_as_is():
    "The script that times an `every=10` run step by step runs end to end on the CPU (tiny model), each writer; figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'gpu_steps.py'), '--device', 'cpu', '--tiny', '--steps', '20', '--rounds', '1'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith('gpt2-small')][1:]
    assert [w[1] for w in rows] == ['bare', 'process', 'thread'], r.stdout
    assert all(w[2] != 'nan' for w in rows[1:]) and rows[0][2] == 'nan', r.stdout   # armed runs recorded steps; bare none

def test_gpu_stats_benchmark_runs_as_is():
    "The script that times ways of measuring many tensors on an accelerator runs end to end on the CPU, every way timed (Triton's in its interpreter)."
    triton = importlib.util.find_spec('triton') is not None
    r = subprocess.run([sys.executable, str(GPU.parent/'gpu_stats.py'), '--device', 'cpu', '--layers', '1', '--repeats', '1',
                        '--ways', 'eager,stacked,segments,triton_one,triton_many,foreach'],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET='1'))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    rows = [l.split() for l in lines[[l.startswith('way') for l in lines].index(True) + 1:]]   # the table's rows
    assert [w[0] for w in rows] == ['eager', 'stacked', 'segments'] + ['triton_one', 'triton_many'] * triton + ['foreach'], r.stdout
    if triton: assert 'triton_many against eager' in r.stdout, r.stdout
    assert all(float(w[1]) > 0 and float(w[2]) >= float(w[1]) for w in rows), r.stdout

def test_hook_floor_benchmark_runs_as_is():
    "The script that times module hooks in a compiled forward runs end to end, each copy timed and its guards profiled; figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'hook_floor.py'), '--rounds', '2', '--calls', '1'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    timed, guards = r.stdout.split("dynamo's guards")   # torch 2.13 has the profiler the second part reads
    rows = [l.split() for l in timed.splitlines() if l.startswith('  ')]
    assert [w[0] for w in rows] == ['control', 'shared', 'partial', 'armed'] and all(w[2] == 'us' for w in rows), r.stdout
    rows = [l.split() for l in guards.splitlines() if l.startswith('  ')]
    assert [w[0] for w in rows] == ['bare', 'control', 'shared', 'partial', 'armed'], r.stdout
    assert all(float(w[1]) > 0 for w in rows), r.stdout
    assert 'machine:' in r.stdout, r.stdout

def test_compile_benchmark_runs_as_is():
    "`bench.py --compile` on blocks made nested compile regions: each way compiled, no break or recompile added."
    r = subprocess.run([sys.executable, str(GPU.parent/'bench.py'), '--compile', '--models', 'gpt2_regions',
                        '--blocks', '1', '--steps', '2'], capture_output=True, text=True, timeout=1800)   # 372 s beside 6 busy processes on 2 cores
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith('gpt2_regions ')]
    assert [w[1] for w in rows] == ['eager', 'whole', 'blocks'], r.stdout
    assert all(w[2] == '0' and w[4] == '0' for w in rows), r.stdout   # graph breaks added, recompiles

def test_gpu_benchmark_compiled_runs_as_is():
    "`gpu.py --compile` runs end to end on the CPU (tiny GPT, inductor): both cadences timed, no break or recompile added."
    r = subprocess.run([sys.executable, str(GPU), '--device', 'cpu', '--tiny', '--blocks', '1', '--steps', '10',
                        '--models', 'gpt2-small', '--compile', 'blocks'], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith('gpt2-small')]
    assert [w[1:3] for w in rows[:2]] == [['blocks', 'every=1'], ['blocks', 'every=10']], r.stdout
    assert 'graph breaks: armed 0, bare 0; graphs compiled after the warm-up: 0' in r.stdout, r.stdout

def test_graph_pass_probe_runs_as_is():
    "The probe of an op put into dynamo's graph with no hooks runs end to end: its op handed tensors, each copy timed; figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'graph_pass_probe.py'), '--rounds', '1', '--steps', '1'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    handed = [l for l in r.stdout.splitlines() if l.startswith("pass_end's op is handed")]
    assert handed and int(handed[0].split()[4]) > 20, r.stdout   # the module calls' last tensors of 6 blocks and the rest
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith('  ')]
    assert [w[0] for w in rows] == ['pass_end', 'pass_each', 'hooks'], r.stdout

def test_compile_split_runs_as_is():
    "The script that splits an armed compiled step's cost runs end to end: every configuration against bare, both ratios; figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'compile_split.py'), '--model', 'mlp32', '--rounds', '1', '--k', '2'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith('  ')]
    assert [w[0] for w in rows] == ['every1', 'nowriter', 'every10', 'the'], r.stdout
    assert all(w[1] == 'wall' and float(w[2].rstrip('x')) > 0 for w in rows[:3]), r.stdout
    writer = re.search(r"the writer thread's CPU a recorded step: ([\d.]+) ms", r.stdout)
    assert writer and float(writer[1]) > 0, r.stdout          # the writer did write, on its own thread
    assert 'machine:' in r.stdout, r.stdout

@pytest.mark.parametrize('lean', [[], ['--bare-unrecorded']], ids=['one-graph', 'bare-unrecorded'])
def test_compile_parts_runs_as_is(lean):
    "The script that times an armed compiled step phase by phase runs end to end: both kinds of step, torchember's own work; figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'compile_parts.py'), '--model', 'mlp32', '--steps', '8', *lean],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith('  ')]
    assert [w[0] for w in rows] == ['unrecorded', 'recorded', 'a'], r.stdout
    assert all(w[4:6] == ['over', 'it:'] and w[6] == 'forward' for w in rows[:2]), r.stdout
    assert 'MB of activations' in r.stdout and 'machine:' in r.stdout, r.stdout
    # a recorded step measures activations; an unrecorded one nothing: the bytes counted are a recorded step's
    assert float(r.stdout.split('ms (')[1].split()[0]) > 0, r.stdout

def test_ingraph_moments_runs_as_is():
    "The in-graph moments benchmark runs end to end: kernels of every way, both models, every variant; figures not checked."
    r = subprocess.run([sys.executable, str(GPU.parent/'ingraph_moments.py'), '--quick'],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'machine:' in r.stdout and r.stdout.count(' elements: ') == 2, r.stdout
    sizes = [l for l in r.stdout.splitlines() if ' elements: ' in l]
    assert all([c.split()[0] for c in l.split(' elements: ')[1].split(' | ')] == ['moments8', 'moments5', 'welford', 'native']
               for l in sizes), r.stdout
    lines = [l.split() for l in r.stdout.splitlines() if l.startswith('  ') and ' bare ' in l]
    assert [l[0] for l in lines] == ['ember', 'graph8', 'graph5', 'welford'] * 2, r.stdout
    # the hooked models ran graphs of their own (not the bare model's): every in-graph variant measured tensors
    assert all(int(l[l.index('tensors') - 1].lstrip('(')) > 0 for l in lines if l[0] != 'ember'), r.stdout

def test_ingraph_moments_measure_what_the_native_kernel_does():
    "The benchmark's in-graph ways compute the native kernel's moments (to float rounding; NaN and Inf counted), so their times compare like with like."
    import torch
    sys.path.insert(0, str(GPU.parent))
    import ingraph_moments as im
    from torchember import native
    torch.manual_seed(0)
    x = torch.randn(5000) * 3 + 1
    x[::7] = 0
    y = x.clone(); y[3], y[10] = float('nan'), float('inf')
    ref = native.moments([x])[0]
    for f in (im.moments8, im.moments_welford): torch.testing.assert_close(f(x), ref, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(im.moments5(x), ref[[1, 2, 3, 4, 5]].float(), rtol=1e-5, atol=1e-2)
    m = im.moments8(y)
    assert m[6] == 1 and m[7] == 1 and m[3].isnan() and m[4].isnan()
