"A finding is declared once (`diagnose.FINDINGS`): one entry reaches `diagnose()`, `ignore=`, the evidence, the report and `doctor`."
import json, os, subprocess, sys
import pytest
from plugins import run_with_plugin

PLUGIN = '''
import numpy as np
from torchember.diagnose import detector, Param, FINDINGS

@detector('loud', 'warning', params=(Param('loud_norm', 100.0, "an output norm above this is loud"),),
          doc="an output whose norm is above `loud_norm`", band=lambda n, loud_norm: (np.zeros(n), np.full(n, loud_norm)))
def loud(look, loud_norm):
    n = look.norms
    out = n[(n['ttype'] == 'output') & (n['step'] >= look.lo) & (n['norm'] > loud_norm)]
    rows = []
    for mid, g in out.groupby('module_id'):
        r, (name, mtype) = g.iloc[0], look.names.loc[mid, ['module', 'mtype']]
        rows.append(FINDINGS['loud'].row(int(r['step']), f"module {name!r} output norm {r['norm']:.3g} above {loud_norm:g}",
                                         module=name, mtype=mtype, ttype='output', stat='norm', value=r['norm'],
                                         expected=f"<= {loud_norm:g}"))
    return rows
'''

SCRIPT = '''
import inspect, json, sys, torch
from torch import nn
import torchember as te
from torchember.diagnose import KINDS, findings_table
from torchember.findings import finding_label, evidence, evidence_figure
db, html = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
with te.torchEmber(model, run='r', db=db):
    for _ in range(12): model(torch.randn(16, 4) * 1000).pow(2).mean().backward()
run = te.load('r', db)
f = run.diagnose()
loud = f[f['kind'] == 'loud']
out = dict(kinds=list(KINDS), table='`loud`' in findings_table(), n=len(loud), modules=sorted(set(loud['module'])),
           quiet=int((run.diagnose(loud_norm=1e12)['kind'] == 'loud').sum()),
           ignored=int((run.diagnose(ignore='loud')['kind'] == 'loud').sum()),
           globbed=int((run.diagnose(ignore='loud:0')['kind'] == 'loud').sum()),
           sig=str(inspect.signature(te.Run.diagnose).parameters['loud_norm'].default))
try: run.diagnose(loud_norm=-1.0)
except ValueError as e: out['refused'] = str(e)
if len(loud):
    row = loud.iloc[0]
    out['label'] = finding_label(row)
    ev = evidence(run, row)
    out['hi'] = sorted(set(ev['hi'])); out['outside'] = bool(ev['outside'].any())
    out['title'] = evidence_figure(ev, row).layout.title.text
te.report('r', html, db=db)
print(json.dumps(out))
'''

def _run(tmp_path, *args, plugin=True): return run_with_plugin(tmp_path, 'loud_finding', PLUGIN, 'TORCHEMBER_FINDINGS', *args, plugin=plugin)

def test_one_entry_reaches_diagnose_ignore_evidence_report_and_doctor(tmp_path):
    db, html = str(tmp_path/'s.db'), tmp_path/'r.html'
    p = _run(tmp_path, '-c', SCRIPT, db, str(html))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out['kinds'][-1] == 'loud' and out['table'] and out['sig'] == '100.0'
    assert out['n'] >= 1 and '0' in out['modules']                       # the first Linear's outputs are loud
    assert out['quiet'] == 0 and out['ignored'] == 0 and out['globbed'] == out['n'] - 1
    assert out['refused'] == "diagnose's loud_norm= must be a finite number > 0, not -1.0"
    assert '· loud ·' in out['label'] and out['outside'] and out['hi'] == [100.0]
    assert out['title'].startswith('loud at step')
    page = html.read_text()
    assert '· loud ·' in page and 'output norm' in page                   # listed, with its evidence, in the report
    cli = lambda *a, **kw: _run(tmp_path, '-m', 'torchember.cli', 'doctor', 'r', '--db', db, *a, **kw)
    p = cli()
    assert p.returncode in (0, 1), p.stderr
    assert ' loud ' in p.stdout and 'above 100' in p.stdout
    p = cli('--loud-norm', '1e12')
    assert p.returncode in (0, 1) and ' loud ' not in p.stdout, p.stderr
    p = cli('--ignore', 'loud')
    assert ' loud ' not in p.stdout, p.stderr
    p = cli('--loud-norm', '-1')
    assert p.returncode == 2 and "loud_norm= must be a finite number > 0" in p.stderr
    assert '--loud-norm' in cli('--help').stdout
    p = _run(tmp_path, '-m', 'torchember.cli', 'doctor', 'r', '--db', db, '--loud-norm', '5', plugin=False)
    assert p.returncode == 2 and 'unrecognized arguments: --loud-norm' in p.stderr   # without the entry, no such finding
