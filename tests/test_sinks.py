"Sinks: a run's global norms, top grad-norm modules and findings, read back from TensorBoard and wandb's offline run."
import glob, json, math, struct, time
from collections import OrderedDict
import pytest
import torch
from torch import nn
from torchember import torchEmber, load
from torchember.sinks import TensorBoardSink, WandbSink

NAN_AT = 12

class Bomb(nn.Module):
    "Passes its input on, except at its call number `NAN_AT` (from 0), where it returns NaN."
    calls = 0
    def forward(self, x):
        self.calls += 1
        return x * float('nan') if self.calls == NAN_AT + 1 else x

def model():
    torch.manual_seed(0)
    layers = [(f'fc{i}', nn.Linear(8, 8)) for i in range(10)]   # 10 layers with grads: more than the 5 published
    return nn.Sequential(OrderedDict(layers[:6] + [('bomb', Bomb())] + layers[6:]))

def train(m, te, sink, steps=16):
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(steps):
        m(torch.randn(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    te.flush()
    sink.close()

def expected(db, run, step):
    "The global weight and grad norms, and the 5 largest module grad norms, of `step`, from the store."
    df = load(run, db).df(step=step)
    root = lambda s: (s ** 2).sum() ** .5
    grads = df[df.ttype == 'weight_grad']
    g = grads.groupby('module')['norm'].apply(root).sort_values(ascending=False)
    return root(df[df.ttype == 'weight']['norm']), root(grads['norm']), list(g.index[:5]), list(g.values[:5])

def test_tensorboard_sink(db, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray
    m = model()
    te = torchEmber(m, run='tb', db=db)
    sink = TensorBoardSink(tmp_path/'tb').attach(te)
    train(m, te, sink)
    ea = EventAccumulator(str(tmp_path/'tb'), size_guidance={'scalars': 0, 'tensors': 0})
    ea.Reload()
    tags = set(ea.Tags()['scalars'])
    assert tags == {'torchember/weight_norm', 'torchember/grad_norm',
                    *(f'torchember/top_grad/{i}' for i in range(1, 6))}
    s = lambda tag: {e.step: e.value for e in ea.Scalars(tag)}
    assert sorted(s('torchember/grad_norm')) == list(range(16))
    w, g, names, tops = expected(db, 'tb', 3)
    assert s('torchember/weight_norm')[3] == pytest.approx(w, rel=1e-6)
    assert s('torchember/grad_norm')[3] == pytest.approx(g, rel=1e-6)
    assert [s(f'torchember/top_grad/{i}')[3] for i in range(1, 6)] == pytest.approx(tops, rel=1e-6)
    text = lambda e: (e.step, make_ndarray(e.tensor_proto).item().decode())
    texts = {t: [text(e) for e in ea.Tensors(t)] for t in ea.Tags()['tensors']}
    named = texts['torchember/top_grad_modules/text_summary']
    at3 = [t for st, t in named if st <= 3][-1]     # the last names said by step 3
    assert at3 == ', '.join(f'{i}: {n}' for i, n in enumerate(names, 1))
    found = texts['torchember/findings/text_summary']
    assert len(found) == 1 and found[0][0] == NAN_AT
    assert f'nonfinite at step {NAN_AT}' in found[0][1] and "module 'bomb'" in found[0][1]
    assert math.isnan(s('torchember/grad_norm')[NAN_AT])
    te.disarm()

def wandb_records(path):
    "The records of a `.wandb` file (wandb's LevelDB-style log: 32 KiB blocks of checksum, length, type and data)."
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, 'rb') as f: data = f.read()
    out, part, pos = [], b'', 7   # after a 7-byte header: ':W&B', magic, version
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        n, kind = struct.unpack('<HB', data[pos + 4:pos + 7])
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):                           # a whole record, or the last piece of a split one
            r = pb.Record()
            r.ParseFromString(part)
            out.append(r)
            part = b''
    return out

def test_wandb_sink_offline(db, tmp_path, monkeypatch):
    wandb = pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    run = wandb.init(project='torchember-test', dir=str(tmp_path))
    try:
        m = model()
        te = torchEmber(m, run='wb', db=db)
        sink = WandbSink().attach(te)
        train(m, te, sink)
        for i in range(3): run.log({'loss': float(i)})   # the script's own logging goes on beside
        te.disarm()
    finally: run.finish()
    path, = glob.glob(str(tmp_path/'wandb'/'offline-run-*'/'run-*.wandb'))
    deadline = time.monotonic() + 60   # wandb's service may still be writing the file as `finish` returns
    ended = lambda recs: any(r.WhichOneof('record_type') == 'exit' for r in recs)
    while not ended(recs := wandb_records(path)) and time.monotonic() < deadline: time.sleep(0.2)
    rows = [{i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof('record_type') == 'history']
    by_step = {}
    for r in rows:
        if 'torchember/step' in r: by_step.setdefault(r['torchember/step'], {}).update(r)
    assert sorted(by_step) == list(range(16))
    w, g, names, tops = expected(db, 'wb', 3)
    assert by_step[3]['torchember/weight_norm'] == pytest.approx(w, rel=1e-6)
    assert by_step[3]['torchember/grad_norm'] == pytest.approx(g, rel=1e-6)
    assert [by_step[3][f'torchember/top_grad/{i}'] for i in range(1, 6)] == pytest.approx(tops, rel=1e-6)
    assert f'nonfinite at step {NAN_AT}' in by_step[NAN_AT]['torchember/findings']
    published = {k for r in rows for k in r if k.startswith('torchember/')}
    assert published == {'torchember/step', 'torchember/weight_norm', 'torchember/grad_norm',
                         'torchember/top_grad_modules', 'torchember/findings',
                         *(f'torchember/top_grad/{i}' for i in range(1, 6))}
    assert sum('loss' in r for r in rows) == 3

def test_wandb_sink_without_a_run_says_so(monkeypatch):
    wandb = pytest.importorskip('wandb')
    monkeypatch.setattr(wandb, 'run', None)
    with pytest.raises(RuntimeError, match=r"call wandb.init\(\) first"): WandbSink()

def test_a_failing_sink_is_warned_and_training_goes_on(db, tmp_path, thread_writer):
    class Broken(TensorBoardSink):
        def scalars(self, step, values): raise OSError('disk full')
    m = model()
    te = torchEmber(m, run='broken', db=db)
    sink = Broken(tmp_path/'tb').attach(te)
    with pytest.warns(RuntimeWarning, match="raised OSError: disk full; training goes on"):
        train(m, te, sink, steps=3)
    assert te.run.n_steps == 3
    te.disarm()
