"""Runs outside the usual shape: models without weights or without grads, bad arguments to `diagnose`, `diff` and
`torchember doctor`. Each must give its report, explorer and findings, or a one-line answer that names the argument."""
import subprocess, sys
import pytest, torch
from torch import nn
import torchember
from torchember import torchEmber, load

def cli(*args):
    return subprocess.run([sys.executable, '-m', 'torchember.cli', *map(str, args)], capture_output=True, text=True, timeout=120)

def no_weights(db, run='bare'):
    "A model with no parameter at all, trained on inputs that need grad (so it has a backward but no weight grads)."
    m = nn.Sequential(nn.ReLU(), nn.Tanh())
    with torchEmber(m, run=run, db=db):
        for _ in range(12): m(torch.randn(8, 4, requires_grad=True)).pow(2).mean().backward()

def frozen(db, run='frozen'):
    "A model whose parameters are all frozen: weights recorded, no weight grads."
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    for p in m.parameters(): p.requires_grad_(False)
    with torchEmber(m, run=run, db=db):
        for _ in range(12): m(torch.randn(8, 4))

@pytest.mark.parametrize('make', [no_weights, frozen])
def test_runs_without_weight_grads_report_explore_and_diagnose(db, tmp_path, make):
    make(db)
    run = load(make.__defaults__[0], db)
    assert 'weight_grad' not in set(run.df()['ttype'])
    page = torchember.report(run.name, tmp_path / 'r.html', db=db).read_text()
    assert 'Plotly' in page and run.name in page
    assert torchember.explore(db, run=run.name).run.name == run.name
    assert len(run.diagnose()) == 0
    p = cli('doctor', run.name, '--db', db)
    assert p.returncode == 0 and 'no findings' in p.stdout

def test_bad_arguments_are_named(db):
    frozen(db)
    r = load('frozen', db)
    for kw, msg in [(dict(window=0), "window= must be an int >= 2"), (dict(window=2.5), "window= must be an int"),
                    (dict(step='7'), "step= must be an int"), (dict(spike=float('nan')), "spike= must be a finite number > 0"),
                    (dict(dead=2), "dead= must be a zero fraction"), (dict(update_band=(1, 0)), "0 <= low < high")]:
        with pytest.raises((TypeError, ValueError), match=msg): r.diagnose(**kw)
    for rtol in (-1, float('nan')):
        with pytest.raises(ValueError, match="diff's rtol= must be a number >= 0"): torchember.diff('frozen', 'frozen', db=db, rtol=rtol)
    with pytest.raises(TypeError, match="rtol= must be a number"): torchember.diff('frozen', 'frozen', db=db, rtol='0')
    p = cli('doctor', 'frozen', '--db', db, '--window', '1')
    assert p.returncode == 2 and p.stderr.strip().splitlines() == ["torchember doctor: diagnose's window= must be an int >= 2 (a band is made of earlier steps), not 1"]
    p = cli('doctor', 'frozen', '--db', db, '--window', '5', '--step', '8')
    assert p.returncode == 0, p.stderr
