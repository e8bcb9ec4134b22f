"Issue 27: the report scales with what matters, not with the model: a wide model's page draws a bounded set of modules."
import re
import numpy as np
import pytest, torch
from torch import nn
from torchember.ember import torchEmber
from torchember.instruments import hist_stats
from torchember.figures import combine, with_stats
from torchember.report import (report_html, report_modules, page_figures, TOP, MODULES_DRAWN, LEFT_OUT_LISTED,
                               FINDINGS_DRAWN)
from torchember.cli import main

pytestmark = pytest.mark.filterwarnings('ignore:torchember. stat function')   # histograms of 800 modules take time
PAIRS = 400   # Linear + ReLU pairs: 801 modules with the model itself

@pytest.fixture(scope='module')
def wide(tmp_path_factory):
    "A run of a model 400 layers wide, three steps, every output's histogram recorded."
    db = tmp_path_factory.mktemp('wide')/'wide.db'
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(PAIRS) for m in (nn.Linear(4, 4), nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torchEmber(model, run='wide', db=str(db)) as te:
        te.how_record_out(hist_stats())
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
    return te.run

@pytest.fixture(scope='module')
def page(wide): return report_html(wide)

def module_heads(page:str)->list:
    "The headings of the page's figures of single modules: '<name> · <type> (why)...'."
    return [h for h in re.findall(r'<h2[^>]*>(.*?)</h2>', page) if ' · ' in h and not h.startswith('Finding')]

def test_the_page_is_bounded(wide, page):
    heads = module_heads(page)
    assert len(page) < 8 * 2**20
    assert len(heads) <= 2 * MODULES_DRAWN                                    # a history and a histogram a module at most
    assert len({h.split(' · ')[0] for h in heads}) <= MODULES_DRAWN
    assert len(page_figures(page)) <= 5 + 2 * MODULES_DRAWN + FINDINGS_DRAWN  # overview (map, scalars, 2 bars, graph), modules, evidence

def test_the_modules_a_reader_looks_at_are_drawn(wide, page):
    g = combine(with_stats(wide.df(ttype='weight_grad')), ['module', 'step'])
    top = g[np.isfinite(g['norm'].astype(float))].groupby('module')['norm'].max().nlargest(TOP).index
    chosen = report_modules(wide).set_index('module')
    assert chosen['drawn'].sum() <= MODULES_DRAWN and len(chosen) == 2 * PAIRS + 1
    assert chosen.loc[['0', str(2 * PAIRS - 2)], 'drawn'].all()              # the first and the last Linear
    assert 'first layer' in chosen.loc['0', 'why'] and 'last layer' in chosen.loc[str(2 * PAIRS - 2), 'why']
    assert chosen.loc[top, 'drawn'].all()
    drawn = {h.split(' · ')[0] for h in module_heads(page)}
    assert {'0', str(2 * PAIRS - 2), *top} <= drawn
    assert drawn <= set(chosen.index[chosen['drawn']])
    for m in chosen.loc[chosen['drawn'] & ~chosen.index.isin(['0', str(2 * PAIRS - 2), *top])].index:
        assert any(w.startswith('finding') for w in chosen.loc[m, 'why'])     # the rest are named by findings

def test_the_left_out_section_says_how_to_ask(wide, page):
    note = page.split('<h2>Modules drawn</h2>')[1].split('<h2')[0]
    assert '--modules' in note and 'torchember report wide' in note and 'modules=[' in note
    left = re.search(r'Left out: (.*?)</p>', note)[1].split(', ')
    assert left[0] == '(root)' and left[-1] == '…' and len(left) == LEFT_OUT_LISTED + 1

def test_modules_asked_for_are_drawn(wide, tmp_path):
    chosen = report_modules(wide).set_index('module')
    one = next(m for m in chosen.index[~chosen['drawn']] if m)               # a module left out by default
    p = main('report', 'wide', db=str(wide.db), Output=str(tmp_path/'r.html'), modules=f'{one}, 1?1')
    heads = module_heads(p.read_text())
    kind = chosen.loc[one, 'type']
    assert f'{one} · {kind} (asked for)' in heads and f'{one} · {kind}: output histogram over steps' in heads
    assert all(f'{m} · ReLU (asked for)' in heads for m in range(101, 200, 10))
    with pytest.raises(ValueError, match="matches 'layers.*'"): report_modules(wide, modules=['layers.*'])
