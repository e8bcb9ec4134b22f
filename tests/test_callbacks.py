"The framework callbacks in real trainers: a Hugging Face `Trainer` and a Lightning `Trainer`, on CPU, for a few steps."
import pickle, subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn
from torchember import load, runs

def _hook_counts(model):
    "How many forward hooks each module and post-accumulate-grad hooks each parameter has."
    return ([len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()],
            [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()])

def _logged(run, name):
    "Logged scalar `name` of `run` as {step: value}."
    sc = run.scalars()
    return dict(zip(sc[sc.name == name].step, sc[sc.name == name].value))

def test_importing_torchember_imports_no_framework():
    code = "import sys, torchember, torchember.callbacks; print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]'

def test_missing_framework_names_the_extra(monkeypatch):
    from torchember.callbacks import EmberHFCallback, EmberLightningCallback
    monkeypatch.setitem(sys.modules, 'transformers', None)
    with pytest.raises(ImportError, match=r"transformers is not installed.*pip install 'torchember\[hf\]'"): EmberHFCallback()
    for m in ('lightning', 'pytorch_lightning'): monkeypatch.setitem(sys.modules, m, None)
    with pytest.raises(ImportError, match=r"lightning is not installed.*pip install 'torchember\[lightning\]'"): EmberLightningCallback()

def test_unknown_option_fails_when_the_callback_is_made():
    from torchember.callbacks import EmberCallback
    with pytest.raises(TypeError, match="not an option of torchEmber: evry"): EmberCallback(evry=2)
    with pytest.raises(TypeError, match="model"): EmberCallback(model=nn.Linear(1, 1))

# Hugging Face

@pytest.fixture
def hf():
    transformers = pytest.importorskip('transformers')
    pytest.importorskip('accelerate')
    return transformers

def _bert(hf):
    torch.manual_seed(0)
    return hf.BertForSequenceClassification(hf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=32, max_position_embeddings=16))

def _hf_trainer(hf, model, out, cb, **args):
    data = [{'input_ids': ids, 'labels': int(ids.sum()) % 2} for ids in torch.randint(0, 50, (24, 8))]
    args = hf.TrainingArguments(output_dir=str(out), **{**dict(max_steps=6, logging_steps=2, per_device_train_batch_size=4, use_cpu=True,
                                report_to=[], save_strategy='no', disable_tqdm=True), **args})
    return hf.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb] if cb is not None else [])

def test_hf_trainer_records_the_run(hf, db, tmp_path):
    from torchember.callbacks import EmberHFCallback
    model, cb = _bert(hf), EmberHFCallback(db=db)
    assert isinstance(cb, hf.TrainerCallback)
    hooks = _hook_counts(model)
    trainer = _hf_trainer(hf, model, tmp_path/'tiny-bert', cb)
    trainer.train()
    r = load('tiny-bert', db)                                  # named after the output folder
    assert r.n_steps == 6 and sorted(r.df().step.unique()) == list(range(6))
    assert r.modules().module.tolist() == [n for n, _ in model.named_modules()]
    assert _hook_counts(model) == hooks and not hasattr(model, 'disarm')    # disarmed at train end
    history = [h for h in trainer.state.log_history if 'loss' in h]
    assert _logged(r, 'global_step') == {1: 2, 3: 4, 5: 6}      # logging steps 2, 4, 6 are torchember's steps 1, 3, 5
    assert _logged(r, 'loss') == pytest.approx({h['step'] - 1: h['loss'] for h in history})
    assert _logged(r, 'learning_rate') == pytest.approx({h['step'] - 1: h['learning_rate'] for h in history})
    st = r.steps().set_index('step')                           # the trainer's grad norm is torchember's, seen from the trainer
    assert st.loc[[1, 3, 5], 'scalar_grad_norm'].tolist() == pytest.approx(st.loc[[1, 3, 5], 'grad_norm'].tolist(), rel=1e-4)
    assert cb.run.name == 'tiny-bert'

def test_hf_run_name_options_and_a_second_training(hf, db, tmp_path):
    from torchember.callbacks import EmberHFCallback
    model, cb = _bert(hf), EmberHFCallback(db=db, every=2, timing=True)
    trainer = _hf_trainer(hf, model, tmp_path/'out', cb, run_name='bert-exp')
    trainer.train()
    r = load('bert-exp', db)
    assert sorted(r.df().step.unique()) == [0, 2, 4] and r.config['every'] == 2 and r.config['timing']
    assert r.calls().fwd_ms.notna().any()
    trainer.train()                                            # the trainer's name again: a new run
    assert load('bert-exp-2', db).n_steps == 3
    named = EmberHFCallback(run='mine', db=db)
    _hf_trainer(hf, model, tmp_path/'out', named, max_steps=2).train()
    assert load('mine', db).n_steps == 2

def test_hf_trainer_torch_compile(hf, db, tmp_path):
    "`torch_compile=True`: no graph break added, parameters as the bare compiled run's, eager's row keys and first weights."
    from torchember.callbacks import EmberHFCallback
    import torch._dynamo as dynamo
    def train(cb, compiled):
        model = _bert(hf)
        dynamo.reset(); dynamo.utils.counters.clear()
        trainer = _hf_trainer(hf, model, tmp_path/'out', cb, max_steps=4, torch_compile=compiled)
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) == compiled
        return model, sum(dynamo.utils.counters['graph_break'].values()), dict(dynamo.utils.counters['stats'])
    bare, bare_breaks, bare_graphs = train(None, True)
    armed, breaks, graphs = train(EmberHFCallback(db=db, run='compiled'), True)
    assert breaks == bare_breaks == 0 and graphs['unique_graphs'] == bare_graphs['unique_graphs']
    for (n, p), q in zip(bare.named_parameters(), armed.parameters()): assert torch.equal(p, q), n   # dropout's RNG too
    train(EmberHFCallback(db=db, run='eager'), False)
    key = ['step', 'module', 'call', 'ttype', 'tname']
    c, e = (load(n, db).df().sort_values(key).reset_index(drop=True) for n in ('compiled', 'eager'))
    assert sorted(c.step.unique()) == [0, 1, 2, 3] and c[key].equals(e[key])
    w = (c.step == 0) & (c.ttype == 'weight')             # before the first update: the same weights, eager or compiled
    assert w.sum() > 20 and c[w]['norm'].tolist() == pytest.approx(e[w]['norm'].tolist(), rel=1e-6)

def test_hf_non_main_process_records_nothing(hf, db, tmp_path):
    from torchember.callbacks import EmberHFCallback
    model = _bert(hf)
    hooks = _hook_counts(model)
    trainer = _hf_trainer(hf, model, tmp_path/'tiny-bert', EmberHFCallback(db=db), max_steps=2)
    trainer.is_world_process_zero = lambda: False
    trainer.train()
    assert not Path(db).exists() and _hook_counts(model) == hooks      # not even a store
    trainer = _hf_trainer(hf, model, tmp_path/'tiny-bert', EmberHFCallback(db=db, all_ranks=True), max_steps=2)
    trainer.is_world_process_zero = lambda: False
    trainer.train()
    assert runs(db).name.tolist() == ['tiny-bert-rank0'] and load('tiny-bert-rank0', db).n_steps == 2

# Lightning

@pytest.fixture
def L():
    return pytest.importorskip('lightning.pytorch')

class _Data(torch.utils.data.Dataset):
    def __init__(self): g = torch.Generator().manual_seed(0); self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    def __len__(self): return 32
    def __getitem__(self, i): return self.x[i], self.y[i]

def _regressor(L, call_self=True, fail_at=None):
    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        def forward(self, x): return self.net(x)
        def training_step(self, batch, batch_idx):
            if self.global_step == fail_at: raise RuntimeError("boom")
            x, y = batch
            loss = nn.functional.mse_loss(self(x) if call_self else self.net(x), y)
            self.log('train_loss', loss)
            return loss
        def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.05)
    torch.manual_seed(0)
    return Regressor()

def _fit(L, module, cb, trainer_cls=None, **kw):
    kw = {**dict(accelerator='cpu', max_steps=6, log_every_n_steps=2, logger=False, enable_checkpointing=False,
                 enable_progress_bar=False, enable_model_summary=False), **kw}
    trainer = (trainer_cls or L.Trainer)(callbacks=[cb], **kw)
    trainer.fit(module, torch.utils.data.DataLoader(_Data(), batch_size=8))
    return trainer

def test_lightning_trainer_records_the_run(L, db, tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    from torchember.callbacks import EmberLightningCallback
    module, cb = _regressor(L), EmberLightningCallback(db=db)
    assert isinstance(cb, L.Callback)
    pickle.loads(pickle.dumps(cb))                              # spawn-based strategies pickle the callbacks
    hooks = _hook_counts(module)
    _fit(L, module, cb, logger=CSVLogger(tmp_path, name='reg'))
    r = load('reg-version_0', db)                              # the logger's name and version
    assert r.n_steps == 6 and sorted(r.df().step.unique()) == list(range(6))
    assert r.modules().module.tolist() == [n for n, _ in module.named_modules()]
    assert _hook_counts(module) == hooks and not hasattr(module, 'disarm')
    assert _logged(r, 'global_step') == {1: 2, 3: 4, 5: 6}
    assert _logged(r, 'lr') == {1: 0.05, 3: 0.05, 5: 0.05}
    loss, train_loss = _logged(r, 'loss'), _logged(r, 'train_loss')
    assert sorted(loss) == [1, 3, 5] and loss == pytest.approx(train_loss)
    assert len(set(r.steps().closed)) == 6                       # every step written, across the epoch boundary

def test_lightning_without_logger_every_and_all_options(L, db, tmp_path):
    from torchember.callbacks import EmberLightningCallback
    module = _regressor(L)
    _fit(L, module, EmberLightningCallback(db=db, every=3, hist=4), default_root_dir=tmp_path/'exp1')
    r = load('exp1', db)                                       # no logger: the root folder's name
    assert sorted(r.df().step.unique()) == [0, 3] and r.config['hist'] == 4

def test_lightning_non_main_rank_records_nothing(L, db, tmp_path):
    from torchember.callbacks import EmberLightningCallback
    class Rank1Trainer(L.Trainer):
        @property
        def global_rank(self): return 1
    module = _regressor(L)
    hooks = _hook_counts(module)
    _fit(L, module, EmberLightningCallback(db=db), Rank1Trainer, max_steps=2, default_root_dir=tmp_path/'exp')
    assert not Path(db).exists() and _hook_counts(module) == hooks
    _fit(L, module, EmberLightningCallback(db=db, all_ranks=True), Rank1Trainer, max_steps=2, default_root_dir=tmp_path/'exp')
    assert runs(db).name.tolist() == ['exp-rank1'] and load('exp-rank1', db).n_steps == 2

def test_lightning_training_step_that_skips_forward(L, db, tmp_path):
    from torchember.callbacks import EmberLightningCallback
    module = _regressor(L, call_self=False)
    with pytest.warns(UserWarning, match="recorded no step.*module='<its name>'"):
        _fit(L, module, EmberLightningCallback(db=db), max_steps=2, default_root_dir=tmp_path/'a')
    _fit(L, module, EmberLightningCallback(db=db, module='net'), max_steps=2, default_root_dir=tmp_path/'b')
    r = load('b', db)
    assert r.n_steps == 2 and r.modules().module.tolist() == [n for n, _ in module.net.named_modules()]

def test_lightning_failed_fit_disarms_and_keeps_what_was_recorded(L, db, tmp_path):
    from torchember.callbacks import EmberLightningCallback
    module = _regressor(L, fail_at=3)
    hooks = _hook_counts(module)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(L, module, EmberLightningCallback(db=db), default_root_dir=tmp_path/'crash')
    assert _hook_counts(module) == hooks
    assert load('crash', db).n_steps == 3

def test_lightning_falls_back_to_pytorch_lightning(monkeypatch):
    pytest.importorskip('pytorch_lightning')
    from torchember.callbacks import _framework
    monkeypatch.setitem(sys.modules, 'lightning', None)
    assert _framework('lightning', 'lightning.pytorch', 'pytorch_lightning').__name__ == 'pytorch_lightning'
