"Issue 29, accelerators: the Triton moments kernels record the same stats as the eager ones, and fall back to them when they fail."
import json, os, subprocess, sys, textwrap
import pytest, torch

pytest.importorskip('triton')

SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings
    import torch
    from torch import nn
    from torchember import torchEmber, stats, triton_moments

    db, how, device = sys.argv[1], sys.argv[2], torch.device(sys.argv[3])
    if device.type == 'cpu': stats.TRITON_DEVICES.add('cpu')   # Triton's interpreter runs the kernels on CPU tensors

    class Block(nn.Module):
        "A residual conv block that changes tensors in place after their hooks saw them (ReLU(inplace), +=)."
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)
        def forward(self, x):
            out = self.bn(self.conv(x))
            out += x
            return self.relu(out)

    class Swap(nn.Module):
        "Outputs a permuted view (dense, not contiguous), as attention layers do: read where it lies, not copied."
        def forward(self, x): return x.transpose(2, 3)

    def model_of(dtype):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(), Swap(), Block(), nn.Flatten(), nn.Linear(4 * 8 * 8, 300),
                             nn.GELU(), nn.Linear(300, 10)).to(device, dtype)

    def record(dtype, db, run):
        model = model_of(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            te = torchEmber(model, db=db, run=run)
            for step in range(3):
                x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(step)).to(device, dtype)
                if step == 2: x[0, 0, 0, 0] = float('nan')
                model(x).float().pow(2).mean().backward(); opt.step(); opt.zero_grad()
            with torch.inference_mode(): model(x)        # inference tensors keep no version counter: read at their hooks
            te.flush()
            df = te.df()
            te.disarm()
        cols = ['step', 'module', 'ttype', 'tname', 'call', 'numel', 'mean', 'std', 'min', 'max', 'norm', 'zero_frac',
                'nan_count', 'inf_count']
        df = df[cols].sort_values(['step', 'module', 'ttype', 'tname', 'call']).reset_index(drop=True)
        return df, [str(x.message) for x in w if str(x.message).startswith('torchember')]

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        launches = []
        add, many = triton_moments.Partials.add, triton_moments.Partials.add_many
        if how == "fails":
            def broken(self, *a, **k): raise RuntimeError('no kernel image is available')
            triton_moments.Partials.add_many = broken
        else:
            add, many = triton_moments.Partials.add, triton_moments.Partials.add_many
            triton_moments.Partials.add = lambda self, t: launches.append(1) or add(self, t)
            triton_moments.Partials.add_many = lambda self, ts, memo=None: launches.append(len(ts)) or many(self, ts, memo)
        stats._TRITON[:] = []
        kernels, warned = record(dtype, db, f'triton-{dtype}')
        at_hooks = launches.count(1)
        if how != "fails":
            os.environ['TORCHEMBER_LATER'] = '0'        # every activation read at its hook, one launch each
            each, _ = record(dtype, db, f'each-{dtype}')
            del os.environ['TORCHEMBER_LATER']
            at_hooks = (at_hooks, launches.count(1) - at_hooks)
        triton_moments.Partials.add, triton_moments.Partials.add_many = add, many
        stats._TRITON[:] = [None]              # the eager kernels, as without Triton
        eager, _ = record(dtype, db, f'eager-{dtype}')
        out[str(dtype)] = dict(kernels=kernels.to_dict('list'), eager=eager.to_dict('list'), warned=warned, launches=launches,
                               at_hooks=at_hooks, each=each.to_dict('list') if how != "fails" else None)
    print(json.dumps(out))
''')


def run(tmp_path, how, device='cpu'):
    "Record with the kernels and without, on `device` (a CPU: in Triton's interpreter, without the native kernel)."
    env = dict(os.environ, TORCHEMBER_NATIVE='0', **({'TRITON_INTERPRET': '1'} if device == 'cpu' else {}))
    p = subprocess.run([sys.executable, '-c', SCRIPT, str(tmp_path / 'k.db'), how, device],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def same(a, b):
    "Equal, NaN where NaN."
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def close(a, b):
    "Equal, or both NaN, or as close as a float32 sum is (the eager kernels sum a large float32 tensor in float32)."
    import math
    return len(a) == len(b) and all(x == y or (x != x and y != y) or (isinstance(x, float) and math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-9))
               for x, y in zip(a, b))


DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])

@pytest.mark.parametrize('device', DEVICES)
def test_kernels_record_what_eager_kernels_record(tmp_path, device):
    "Every row of three steps and an inference call (in-place changes, a permuted view, a NaN input, float32 and bfloat16): the same stats."
    for dtype, r in run(tmp_path, 'works', device).items():
        k, e = r['kernels'], r['eager']
        assert not r['warned'], r['warned']
        assert len(k['step']) == len(e['step']) > 40, dtype
        for c in k:
            assert close(k[c], e[c]), (dtype, c, [(i, x, y) for i, (x, y) in enumerate(zip(k[c], e[c])) if not close([x], [y])][:5])
            # read at their hooks or batched: the same (on a GPU, cuDNN's backward makes two trainings differ a little)
            assert (same if device == 'cpu' else close)(k[c], r['each'][c]), (dtype, c)
        assert sum(k['nan_count']) > 0, dtype              # the NaN of step 2 was counted
        batched, each = r['at_hooks']     # one-tensor launches over the three steps: activations batched, and not
        assert 0 < batched < each, r["at_hooks"]     # batched once seen unchanged; the first step and in-place ones at hooks


@pytest.mark.parametrize('device', DEVICES)
def test_a_failing_kernel_falls_back_to_eager(tmp_path, device):
    "A Triton kernel that raises is said once; that step's weights and grads and every later tensor are still measured."
    for dtype, r in run(tmp_path, 'fails', device).items():
        k, e = r['kernels'], r['eager']
        assert len(r['warned']) == 1 and 'Triton' in r['warned'][0], r['warned']
        assert len(k['step']) == len(e['step'])
        for c in k: assert close(k[c], e[c]), (dtype, c)


SOMETIMES = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from torch import nn
    from torchember import torchEmber, stats

    db, device = sys.argv[1], torch.device(sys.argv[2])
    if device.type == 'cpu': stats.TRITON_DEVICES.add('cpu')

    class Sometimes(nn.Module):
        "Changes its layer's output in place at step 2 only, after the layer's hook saw it."
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
        def forward(self, x, step):
            y = self.lin(x)
            if step == 2: y.mul_(2)
            return y

    torch.manual_seed(0)
    model = Sometimes().to(device)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        te = torchEmber(model, db=db)
        for step in range(4): model(torch.ones(2, 8, device=device), step).sum().backward()
        te.flush()
        df = te.df()
        te.disarm()
    out = df[(df.module == 'lin') & (df.ttype == 'output')].sort_values('step')
    print(json.dumps(dict(steps=out.step.tolist(), mean=out['mean'].tolist(),
                          warned=[str(x.message) for x in w if str(x.message).startswith('torchember')])))
''')


@pytest.mark.parametrize('device', DEVICES)
def test_a_batched_tensor_changed_in_place_is_said(tmp_path, device):
    "A layer's output changed in place at one step only, after it was batched: that step's row is empty and said, the others right."
    env = dict(os.environ, TORCHEMBER_NATIVE='0', **({'TRITON_INTERPRET': '1'} if device == 'cpu' else {}))
    p = subprocess.run([sys.executable, '-c', SOMETIMES, str(tmp_path / 's.db'), device], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r['steps'] == [0, 1, 2, 3]
    m = r['mean']
    assert m[0] == m[1] == m[3] and m[2] != m[2], m          # the same input each step; step 2 left empty (NaN)
    assert len(r['warned']) == 1 and 'changed in place' in r['warned'][0] and 'step 2' in r['warned'][0], r['warned']


def test_a_cpu_run_never_imports_triton(tmp_path):
    "Recording on a CPU never imports Triton (about 0.3 s, and a compiler it would look for): only a CUDA tensor does."
    code = textwrap.dedent('''
        import sys, torch
        from torch import nn
        from torchember import torchEmber
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        te = torchEmber(model, db=sys.argv[1])
        for _ in range(2): model(torch.randn(3, 4)).sum().backward()
        te.flush()
        assert len(te.df()) > 0
        print('triton' in sys.modules)
    ''')
    p = subprocess.run([sys.executable, '-c', code, str(tmp_path / 'c.db')], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == 'False'
