"""A compiled region's accelerator tensors go to the Triton kernels in one launch a device (issue 48), as eager's do.

No GPU here: with no native kernel (`TORCHEMBER_NATIVE=0`), Triton's interpreter (`TRITON_INTERPRET=1`) and the CPU
counted among Triton's devices, CPU tensors take the path a GPU's take. A model compiled whole, and one block by
block, records every row an eager armed run records, with the same stats; and each region's activations are started by
one `_on_device` call, none measured one by one (`measure_now`), where before this each was a launch of its own.
"""
import json, os, subprocess, sys, textwrap
from pathlib import Path
import numpy as np, pandas as pd
import pytest

pytest.importorskip('triton')

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[3])
    from corpus import gpt_like
    from torchember import torchEmber, stats
    from torchember.stats import Recorder
    stats.TRITON_DEVICES.add('cpu')   # Triton's interpreter runs the kernels on CPU tensors
    calls = {'_on_device': 0, 'measure_now': 0}   # the latter: of float tensors only (token ids take torch's kernels)
    on_device, measure_now = Recorder._on_device, Recorder.measure_now
    def _on_device_counted(self, ts, *a, **k):
        calls['_on_device'] += 1
        return on_device(self, ts, *a, **k)
    def measure_now_counted(self, mi, call, ttype, tname, t):
        calls['measure_now'] += t.is_floating_point()
        return measure_now(self, mi, call, ttype, tname, t)
    Recorder._on_device, Recorder.measure_now = _on_device_counted, measure_now_counted

    db, how = sys.argv[1], sys.argv[2]
    model, make = gpt_like(layers=2, d=16, heads=2, vocab=32, seq=8, batch=2)
    te = torchEmber(model, run=how, db=db)
    call = torch.compile(model) if how == 'whole' else model
    if how == 'blocks':
        for b in model.blocks: b.compile(fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(3):
        if s == 1: calls.update({k: 0 for k in calls})   # counted from a warm step on
        args, kw = make(s)
        call(*args, **kw).float().square().mean().backward()
        opt.step(); opt.zero_grad()
    te.flush()
    print(json.dumps(calls))
''')

KEYS = ['step', 'module', 'call', 'ttype', 'tname']

def record(tmp_path, how):
    "Run the script for `how` (eager, whole, blocks); its rows and the counts of its measuring calls."
    db = tmp_path / f'{how}.db'
    env = dict(os.environ, TORCHEMBER_NATIVE='0', TRITON_INTERPRET='1')
    r = subprocess.run([sys.executable, '-c', SCRIPT, str(db), how, str(Path(__file__).parent)], capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    from torchember import load
    df = load(how, str(db)).df().sort_values(KEYS).reset_index(drop=True)
    return df, json.loads(r.stdout.strip().splitlines()[-1])

@pytest.fixture(scope='module')
def eager(tmp_path_factory): return record(tmp_path_factory.mktemp('launched'), 'eager')

@pytest.mark.parametrize('how', ['whole', 'blocks'])
def test_rows_equal_eager_one_launch_a_region(tmp_path, eager, how):
    c, calls = record(tmp_path, how)
    e, _ = eager
    assert set(c.ttype) == {'input', 'output', 'weight', 'weight_grad'} and len(set(c.step)) == 3
    assert c[KEYS + ['shape', 'dtype']].equals(e[KEYS + ['shape', 'dtype']])
    for col in ['numel', 'mean', 'std', 'min', 'max', 'norm', 'nan_count', 'inf_count']:
        np.testing.assert_allclose(c[col].to_numpy(float), e[col].to_numpy(float), rtol=1e-5, atol=1e-6, err_msg=col)
    assert calls['measure_now'] == 0, calls
    acts = len(c[(c.step > 0) & c.ttype.isin(['input', 'output'])])   # the activation rows of the two steps counted
    print(how, calls, acts)
    assert 0 < calls['_on_device'] <= acts // 4, (calls, acts)   # a launch a region (and the weights' and grads'), not a tensor
