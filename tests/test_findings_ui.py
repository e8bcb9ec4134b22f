"Issue 20: the findings list at the top of the explorer and the report, and each finding's evidence (its series, its band, its step)."
import math, re
import numpy as np
import pytest, torch
from torch import nn
from importlib import import_module
from torchember import load
from torchember.query import Run
from torchember.findings import evidence, evidence_figure, finding_label
from torchember.report import report_html, page_figures
from test_diagnose import mlp, train, scale_up, poison

tx = import_module('torchember.explore')   # the module: the package's `explore` is its function

@pytest.fixture
def scaled(store):
    "A run whose layer 6 has its weights multiplied by 10 before step 40: the loss, the grad norm and layer 6's output spike there."
    return train(mlp(), 'scaled', store, tweak=scale_up)

def test_every_kind_has_evidence_that_shows_the_finding(db):
    "Each kind of finding draws: its series holds the finding's step; a spike's and a dead output's values there lie outside the band."
    def neg_bias(s, m):
        if s == 0:
            with torch.no_grad(): m[0].bias.fill_(-100)
    m = mlp()
    opt = torch.optim.Adam([{'params': m[0].parameters(), 'lr': 0.5}, {'params': m[2:].parameters(), 'lr': 1e-3}])
    runs = [train(mlp(), 'scaled', db, tweak=scale_up), train(mlp(), 'dead', db, steps=30, tweak=neg_bias),
            train(mlp(depth=12, act=nn.Sigmoid), 'sigmoid', db, steps=20), train(m, 'hot', db, steps=30, opt=opt, track_updates=True),
            train(mlp(), 'nan', db, steps=20, tweak=poison)]
    seen = set()
    for r in runs:
        for _, f in r.diagnose().iterrows():
            ev = evidence(r, f)
            seen.add(f['kind'])
            assert f['step'] in ev['step'].tolist(), (f['kind'], f['message'])
            at = ev[ev['step'] == f['step']].iloc[0]
            if f['kind'] in ('dead', 'nonfinite') or (f['kind'] == 'spike' and f['stat'] == 'rms'):
                assert at['outside'], (f['kind'], f['message'], ev)
            if f['kind'] == 'spike' and f['stat'] == 'rms' or f['kind'] == 'dead':
                assert math.isclose(at['value'], f['value'], rel_tol=1e-9)
            if f['kind'] == 'update_ratio': assert ev['outside'].mean() > 0.5 and (ev['hi'] == 0.03).all()
            fig = evidence_figure(ev, f)
            assert fig.layout.shapes[0].x0 == f['step'] and fig.layout.title.text.startswith(f"{f['kind']} at step {f['step']}")
    assert {'spike', 'dead', 'vanishing', 'update_ratio', 'nonfinite'} <= seen

def test_explorer_lists_findings_and_opens_their_evidence(scaled, store):
    ex = tx.explore(store, run='scaled')
    try:
        labels = [l for l, _ in ex.findings_picker.options]
        assert labels and ex.findings_picker.layout.display is None
        assert labels[0] == finding_label(ex.findings.iloc[0])
        assert ex.findings_picker.value is None and not ex.plots['evidence'].shown
        i = next(i for i, l in enumerate(labels) if l.endswith('· cause · 6 (Linear) weight'))   # the module that started it
        assert i == 0
        ex.findings_picker.value = i
        ev = ex.plots['evidence']
        assert ev.shown and ev.title == 'cause at step 40 (it. 40): 6 (Linear), weight RMS over steps'
        assert ev.yaxis.domain[1] == max(p.yaxis.domain[1] for p in ex.plots.values())   # on top of the figure
        assert [s.x0 for s in ev.shapes] == [40]
        out = next(t for t in ev.data if t.name == 'outside the band')
        assert out.x[0] == 40
        assert (ex.module_picker.value, ex.ttype_picker.value, ex.stat_picker.value, ex._mark) == ('6', 'weight', ('norm',), 40)
        assert 'step 40 marked (it. 40)' in ex.plots['history'].title
        assert "module '6' (Linear)" in ex.finding_text.value
        ex.refresh()                                                 # a redraw keeps the finding open
        assert ex.findings_picker.value == i and ex.plots['evidence'].shown
        ex.findings_picker.value = None
        assert not ex.plots['evidence'].shown and ex.finding_text.value == ''
    finally: ex.close()

def test_explorer_says_when_nothing_is_wrong_and_survives_a_failing_diagnosis(db, monkeypatch):
    train(mlp(), 'calm', db, steps=30)
    ex = tx.explore(db, run='calm')
    try:
        assert ex.findings.empty and 'none' in ex.findings_head.value and ex.findings_picker.layout.display == 'none'
        def broken(self, **kw): raise RuntimeError('store went away')
        monkeypatch.setattr(Run, 'diagnose', broken)
        ex.refresh_findings(force=True).refresh()
        assert 'diagnose failed: RuntimeError: store went away' in ex.findings_head.value
        assert ex.plots['history'].shown and ex.plots['map'].shown    # the rest still draws
        page = report_html(load('calm', db))
        assert 'diagnose() failed: RuntimeError: store went away' in page and page.count('plotly.js v') == 1
    finally: ex.close()

def test_live_explorer_diagnoses_at_most_every_few_seconds(scaled, store, monkeypatch):
    ex = tx.explore(store, run='scaled')
    calls = []
    real = Run.diagnose
    monkeypatch.setattr(Run, 'diagnose', lambda self, **kw: calls.append(1) or real(self, **kw))
    try:
        ex.refresh(); ex.overlay_picker.value = 'scaled'; ex.overlay_picker.value = ''
        assert len(calls) == 0                                       # no new step: the findings stand
        ex._steps.append(ex._steps[-1] + 1)                          # as if a step had come
        ex.refresh()
        assert len(calls) == 1
        ex.live_toggle.value = True
        ex.stop_button.click(); ex._thread.join(60)
        assert not ex._thread.is_alive()                             # no poll of its own among the counted refreshes
        with ex._quiet(): ex.live_toggle.value = True                 # live, without its thread: refreshes by hand
        for _ in range(3):
            ex._steps.append(ex._steps[-1] + 1)
            ex.refresh()
        assert len(calls) == 1                                       # new steps, but within DIAGNOSE_EVERY of the last diagnosis
        ex._diag_at -= tx.DIAGNOSE_EVERY
        ex.refresh()
        assert len(calls) == 2
    finally:
        ex._stop.set(); ex.close()

def test_report_lists_findings_on_top_linked_to_their_evidence(scaled):
    page = report_html(scaled)
    fs = scaled.diagnose()
    assert page.index('<h2>Findings</h2>') < page.index('<h2>NaN and Inf</h2>') < page.index('Plotly.newPlot')
    table = page.split('<h2>Findings</h2>')[1]                          # the story above it links the cause's evidence too
    links = re.findall(r'<a href="#(finding-\d+)">evidence</a>', table)
    assert len(links) == min(len(fs), 8)
    anchors = re.findall(r'<h2 id="(finding-\d+)">', page)
    assert set(links) == set(anchors) and len(anchors) < len(links)   # the loss's spike and the grad norm's share their cause's evidence
    titles = [l.get('title', {}).get('text', '') for _, l in page_figures(page)]
    assert 'cause at step 40 (it. 40): 6 (Linear), weight RMS over steps' in titles
    assert page.count('plotly.js v') == 1
