"""Issue 25: steps and iterations. A torchember step is one call of the armed model; a user counts iterations (optimizer
steps). The explorer, its figures, the findings and the report name each step's iteration beside it; they draw weight
grads at the steps whose grads the optimizer applied (under gradient accumulation a micro-step's weight grad is a
running sum), with a way to see every step; they tell eval and no_grad steps apart; and the report's NaN/Inf table
counts what the model made or holds, not the inputs it is fed (a causal attention mask is -inf by design)."""
import re
from importlib import import_module
import pytest, torch
from torch import nn
from torchember import torchEmber, load
from torchember.findings import finding_label
from torchember.report import report_html, page_figures, nonfinite

tx = import_module('torchember.explore')   # the module: the package's `explore` is its function

ITERS, MICRO = 6, 2
TRAIN = list(range(ITERS * MICRO))                          # the training calls: micro-steps 0 .. 11
APPLIED = [s for s in TRAIN if s % MICRO == MICRO - 1]     # each iteration's last micro-step: 1, 3, ..., 11
EVAL = len(TRAIN)                                          # the validation call after training, step 12
BAD_AT = 7                                                 # 'accum-nan': a NaN in this micro-step's input (iteration 3)

def accumulate(db, run, nan_at=None):
    "A small MLP trained with gradient accumulation, MICRO calls per SGD step for ITERS steps (histograms on), then a validation call."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchEmber(model, run=run, db=db, hist=8):
        for step in TRAIN:
            x = torch.randn(16, 4)
            if step == nan_at: x[0, 0] = float('nan')
            model(x).pow(2).mean().backward()
            if step in APPLIED: opt.step(); opt.zero_grad()
        model.eval()
        with torch.no_grad(): model(torch.randn(16, 4))
    return load(run, db)

@pytest.fixture(scope='module')
def acc(tmp_path_factory):
    "A store with run 'accum' and run 'accum-nan', both trained as `accumulate` trains."
    db = str(tmp_path_factory.mktemp('iterations')/'store.db')
    accumulate(db, 'accum')
    accumulate(db, 'accum-nan', nan_at=BAD_AT)
    return db

def test_the_runs_count_iterations(acc):
    k = load('accum', acc).step_kinds()
    assert k['iteration'].tolist() == [s // MICRO for s in TRAIN] + [ITERS]
    assert k['kind'].tolist() == ['train'] * len(TRAIN) + ['eval']

# the explorer

def scalar(ex, i=0):
    "The `i`th trace of the explorer's training scalars (a run with nothing logged: grad_norm first, then weight_norm)."
    return ex.plots['scalars'].data[i]

def test_explorer_draws_weight_grads_at_the_applied_steps(acc):
    ex = tx.explore(acc, run='accum')
    try:
        assert ex.ov_ttype.value == 'weight_grad'
        assert ex.map_data['x'] == APPLIED                          # the map: no micro-step, no eval step
        assert set(ex.overview_df['step']) == {APPLIED[-1]}          # the bars: the newest applied step, not the validation call
        ex.select('0', 'weight_grad', 'norm')
        assert ex.history_df['step'].tolist() == APPLIED
        assert list(ex.plots['histogram'].data[0].x) == APPLIED
        assert 'over applied steps' in ex.plots['history'].title
        assert list(scalar(ex).x) == APPLIED                         # the global grad norm too
        ex.all_steps_toggle.value = True                             # every training step, micro-steps included
        assert ex.map_data['x'] == TRAIN and ex.history_df['step'].tolist() == TRAIN and list(scalar(ex).x) == TRAIN
        assert 'over applied steps' not in ex.plots['history'].title
        ex.all_steps_toggle.value = False
        ex.ttype_picker.value = 'output'                             # outputs: every step, the validation call's too
        assert ex.history_df['step'].tolist() == TRAIN + [EVAL]
    finally: ex.close()

def test_explorer_hovers_and_titles_name_the_iteration(acc):
    ex = tx.explore(acc, run='accum')
    try:
        hm = ex.plots['map'].data[0]
        assert 'step %{x} · iteration %{customdata[0]} · train' in hm.hovertemplate
        assert [c[0] for c in hm.customdata[0]] == list(range(ITERS))     # each cell carries its column's iteration
        assert ex.plots['map'].xaxis.title.text == 'step (hover for iteration)'
        ex.select('0', 'output', 'mean')
        mean = next(t for t in ex.plots['history'].data if t.name == 'mean')
        assert 'step %{x} · iteration %{customdata[0]} · %{customdata[1]}' in mean.hovertemplate
        assert [list(c) for c in mean.customdata] == [[s // MICRO, 'train'] for s in TRAIN] + [[ITERS, 'eval']]
        assert ex.plots['history'].xaxis.title.text == 'step (hover for iteration)'
        assert list(ex.plots['histogram'].data[0].customdata[0][-1]) == [ITERS, 'eval']
        assert 'iteration %{customdata[0]}' in scalar(ex).hovertemplate and list(scalar(ex).customdata[0]) == [0, 'train']
        ex.select('0', 'weight_grad', 'norm', step=BAD_AT)
        assert f'step {BAD_AT} marked (it. {BAD_AT // MICRO})' in ex.plots['history'].title
    finally: ex.close()

def test_explorer_findings_and_status_name_the_iteration(acc):
    ex = tx.explore(acc, run='accum-nan')
    try:
        assert ex.status.value.endswith(f'first NaN/Inf: 0 (Linear) output at step {BAD_AT} (it. {BAD_AT // MICRO})')
        i, label = next((i, l) for l, i in ex.findings_picker.options if '· nonfinite ·' in l)
        assert label.startswith(f'✖ error · step {BAD_AT} (it. {BAD_AT // MICRO}) · nonfinite · 0 (Linear) output')
        ex.findings_picker.value = i
        assert ex.plots['evidence'].title.startswith(f'nonfinite at step {BAD_AT} (it. {BAD_AT // MICRO}): 0 (Linear)')
        value = ex.plots['evidence'].data[0]
        assert 'iteration' in value.hovertemplate
    finally: ex.close()
    f = dict(severity='warning', step=22, iteration=11, kind='spike', module='2', mtype='Linear', ttype='output', tname='output', stat='rms')
    assert finding_label(f) == '▲ warning · step 22 (it. 11) · spike · 2 (Linear) output'
    assert finding_label({**f, 'iteration': None}) == '▲ warning · step 22 · spike · 2 (Linear) output'

def test_a_binned_map_shows_each_column_at_its_first_applied_step(acc):
    from torchember.figures import module_map
    m = module_map(load('accum-nan', acc), bins=4, steps=APPLIED)   # 13 steps in columns of 4: 0-3, 4-7, 8-11, 12
    assert m['width'] == 4 and m['x'] == [1, 5, 9]                  # the eval step's column has no applied step: left out
    assert m['bad'].any(0).tolist() == [False, True, True]           # NaN from step 7 on, in the columns that hold it

# the report

def test_report_draws_applied_steps_and_names_iterations(acc):
    page = report_html(load('accum-nan', acc))
    figs = page_figures(page)
    assert figs[0][0][0]['type'] == 'heatmap' and figs[0][0][0]['x'] == APPLIED
    assert '<h2>Every module: weight_grad norm over applied steps</h2>' in page
    assert '<h2>Step 5 (it. 2), the last before NaN/Inf: weight_grad norm per module</h2>' in page
    assert '<h2>Step 6 (it. 3), the last before NaN/Inf: output std per module</h2>' in page
    assert re.search(rf'<h2 id="finding-\d+">Finding \d+: ✖ error · step {BAD_AT} \(it\. 3\) · nonfinite · 0 \(Linear\) output</h2>', page)
    assert '<th>step</th><th>iteration</th>' in page
    assert f'First NaN/Inf: <b>0</b> (Linear) output at step {BAD_AT} (it. 3), call 0' in page
    titles = {a['title']['text'] for _, l in figs for k, a in l.items() if re.fullmatch(r'xaxis\d*', k) and 'title' in a}
    assert 'step (hover for iteration)' in titles and 'step' not in titles
    grads = [t for traces, _ in figs for t in traces if t.get('name') == 'weight_grad norm']
    assert grads and all(t['x'] == APPLIED for t in grads)           # each module's grad norm: at the applied steps
    clean = report_html(load('accum', acc))
    assert '<h2>Latest applied step: weight_grad norm per module</h2>' in clean

class LM(nn.Module):
    "A one-layer causal Transformer language model: its attention mask is -inf above the diagonal, by design."
    def __init__(self, vocab=16, d=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
    def forward(self, x):
        return self.head(self.enc(self.emb(x), mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]), is_causal=True))

def test_report_counts_what_the_model_made_not_its_mask(tmp_path):
    db = str(tmp_path/'lm.db')
    torch.manual_seed(0)
    lm = LM()
    opt = torch.optim.SGD(lm.parameters(), lr=0.1)
    with torchEmber(lm, run='lm', db=db):
        for _ in range(3):
            x = torch.randint(0, 16, (4, 8))
            nn.functional.cross_entropy(lm(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step(); opt.zero_grad()
    r = load('lm', db)
    assert nonfinite(r).empty                                        # nothing the model made or holds
    part = report_html(r).split('<h2>NaN and Inf</h2>')[1].split('<h2')[0]
    assert 'No NaN or Inf in any output, weight or grad' in part and 'First NaN/Inf' not in part and '<table' not in part
    note = re.search(r'<p class="info">Inputs that arrive non-finite[^<]*</p>', part)
    assert note and 'enc mask' in note[0] and 'enc.layers.0.self_attn attn_mask' in note[0]
    masks = nonfinite(r, inputs=True)                                # listed apart
    assert set(masks['ttype']) == {'input'} and (masks['inf'] > 0).all() and masks['nan'].sum() == 0


def test_a_value_logged_once_an_iteration_draws_a_line():
    "A loss logged at each iteration's last micro-step is drawn through those steps, not as a line broken at every other step."
    import numpy as np, pandas as pd
    from torchember.figures import scalars_figure
    st = pd.DataFrame({'step': range(8), 'rank': 0, 'iteration': [0] * 4 + [1] * 4, 'kind': 'train', 'grad_norm': np.arange(8.),
                       'weight_norm': 1.0, 'loss': [np.nan] * 3 + [3.0] + [np.nan] * 3 + [2.5]})
    loss = [t for t in scalars_figure(st).data if t.hovertemplate.startswith('loss')][0]
    assert (list(loss.x), list(loss.y)) == ([3, 7], [3.0, 2.5])
