"The model corpus: every model records all four ttypes with the right names, and arming never changes results."
import copy
import pytest, torch
from torch import nn
from corpus import CORPUS, loss_of, train_step
from torchember import torchEmber, load

def flat(out):
    if isinstance(out, torch.Tensor): return [out]
    if isinstance(out, dict): return [t for v in out.values() for t in flat(v)]
    if isinstance(out, (tuple, list)): return [t for v in out for t in flat(v)]
    return []

@pytest.mark.parametrize('name', list(CORPUS))
def test_armed_equals_bare(name, db):
    model, make_batch = CORPUS[name]()
    bare = copy.deepcopy(model)
    te = torchEmber(model, run=name, db=db)
    for step in range(3):
        batch = make_batch(step)
        o1, o2 = train_step(bare, batch, step), train_step(model, batch, step)
        for a, b in zip(flat(o1), flat(o2), strict=True): assert torch.equal(a, b)
        for (n, p1), (_, p2) in zip(bare.named_parameters(), model.named_parameters(), strict=True):
            assert (p1.grad is None) == (p2.grad is None), n
            if p1.grad is not None: assert torch.equal(p1.grad, p2.grad), n
        for m in (bare, model):
            for p in m.parameters(): p.grad = None
    te.disarm()
    for (n, b1), (_, b2) in zip(bare.named_buffers(), model.named_buffers()): assert torch.equal(b1, b2), n

@pytest.mark.parametrize('name', list(CORPUS))
def test_records(name, db):
    model, make_batch = CORPUS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    te = torchEmber(model, run=name, db=db)
    for step in range(3):
        train_step(model, make_batch(step), step); opt.step(); opt.zero_grad()
    df, latest = te.df(), te.latest()
    assert set(df.ttype) == {'input', 'output', 'weight', 'weight_grad'}
    assert sorted(df.step.unique()) == [0, 1, 2]
    assert latest.step.unique().tolist() == [2]
    assert len(latest) == len(df[df.step == 2])
    names = dict(model.named_modules())
    for m in df.module.unique(): assert model.get_submodule(m) is names[m]
    assert (df.mtype == [type(names[m]).__name__ for m in df.module]).all()
    # weights and grads: once per parameter per step, under the module that owns it
    w = latest[latest.ttype == 'weight']
    assert sorted(w.module + '.' + w.tname) == sorted(f'{m}.{p}'.lstrip('.') if m else p for m, mod in model.named_modules()
                                                       for p, _ in mod.named_parameters(recurse=False))
    g = latest[latest.ttype == 'weight_grad']
    assert len(g) == sum(p.requires_grad for p in model.parameters())
    # stats of a weight match torch's own
    row = w.iloc[0]
    p = model.get_submodule(row.module).get_parameter(row.tname) if row.module else model.get_parameter(row.tname)
    # `latest` is step 2, whose weights were taken before opt.step() of step 2
    assert row['numel'] == p.numel() and row['shape'] == tuple(p.shape)
    # the stored run reads back the same without the model
    r = load(name, db)
    assert r.latest().equals(latest)
    assert r.tree() == te.tree()
    assert r.sequence() == te.sequence()
    te.disarm()

def test_names_of_nested_inputs_and_outputs(db):
    model, make_batch = CORPUS['kwargs_dict']()
    te = torchEmber(model, run='kw', db=db)
    train_step(model, make_batch(0), 0)
    root = te.latest().query("module == ''")
    assert set(root[root.ttype == 'input'].tname) == {'x', 'extra'}
    assert set(root[root.ttype == 'output'].tname) == {'output.logits', 'output.hidden'}
    model, make_batch = CORPUS['lstm']()
    te = torchEmber(model, run='lstm', db=db)
    train_step(model, make_batch(0), 0)
    lstm = te.latest().query("mtype == 'LSTM' and ttype == 'output'")
    assert sorted(lstm.tname) == ['output.0', 'output.1.0', 'output.1.1']
    model, make_batch = CORPUS['namedtuple']()
    te = torchEmber(model, run='nt', db=db)
    train_step(model, make_batch(0), 0)
    assert {'output.logits', 'output.hidden'} <= set(te.latest().query("module == '' and ttype == 'output'").tname)

def test_module_called_twice_gets_two_calls(db):
    model, make_batch = CORPUS['shared_twice']()
    te = torchEmber(model, run='twice', db=db)
    train_step(model, make_batch(0), 0)
    block = te.latest().query("module == 'block' and ttype == 'output'")
    assert sorted(block['call']) == [0, 1]
    seq = te.sequence()
    assert seq.count('enter block') == 2 and seq.count('exit block') == 2
    # weights once per step even though the block ran twice
    assert len(te.latest().query("module.str.startswith('block') and ttype == 'weight'", engine='python')) == \
        sum(1 for _ in model.block.parameters())

def test_transformer_kwarg_mask_recorded(db):
    model, make_batch = CORPUS['transformer']()
    te = torchEmber(model, run='tf', db=db)
    train_step(model, make_batch(0), 0)
    root_in = te.latest().query("module == '' and ttype == 'input'")
    assert 'src_key_padding_mask' in set(root_in.tname)
    mask = root_in.set_index('tname').loc['src_key_padding_mask']
    assert mask['dtype'] == 'bool'
