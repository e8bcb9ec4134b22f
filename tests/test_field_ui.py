"""What a user sees and manages (issue 19): runs deleted and overwritten, the command line's errors and commands, the
training scalars, the overview on a blown-up run, the model-at-a-glance heatmap, and the report's layout."""
import json, re, subprocess, sys
from pathlib import Path
import numpy as np
import pytest, torch
import sqlalchemy as sa
from torch import nn
import torchember
from torchember import torchEmber, load, runs
from torchember.store import engine, metadata

def tiny(): return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def train(db, run, steps=5, blow_up_at=None, seed=0, **kw):
    "A tiny MLP trained `steps` steps with `loss` and `lr` logged; from step `blow_up_at` on its inputs hold a NaN."
    torch.manual_seed(seed)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchEmber(model, run=run, db=db, **kw) as te:
        for step in range(steps):
            x = torch.rand(16, 4)
            if blow_up_at is not None and step >= blow_up_at: x[0, 0] = float('nan')
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            te.log(loss=loss, lr=0.1)
    return model

def rows_of(db, run_id)->dict:
    "table -> rows of run `run_id`, for every table that has a run's rows."
    with engine(db).connect() as c:
        return {t.name: c.execute(sa.select(sa.func.count()).select_from(t).where((t.c.id if t.name == 'runs' else t.c.run_id) == run_id)).scalar()
                for t in metadata.sorted_tables if t.name == 'runs' or 'run_id' in t.c}

def cli(*args, cwd=None):
    return subprocess.run([sys.executable, '-m', 'torchember.cli', *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)

# A. runs you can manage

def test_delete_run_removes_every_row(db):
    train(db, 'keep'); train(db, 'gone', timing=True, snapshot='0.weight')
    gid, kid = load('gone', db).id, load('keep', db).id
    before, kept = rows_of(db, gid), rows_of(db, kid)
    assert before['stats'] and before['steps'] and before['scalars'] and before['calls'] and before['snapshots']
    gone = torchember.delete_run('gone', db)
    assert {k: v for k, v in gone.items() if v} == {k: v for k, v in before.items() if v}
    assert set(rows_of(db, gid).values()) == {0} and rows_of(db, kid) == kept
    assert runs(db)['name'].tolist() == ['keep']
    with pytest.raises(KeyError, match=r"no run named 'gone' in store .*; runs there: 'keep'"): torchember.delete_run('gone', db)

def test_delete_run_is_one_transaction(db, monkeypatch):
    "A delete that fails half way leaves every row where it was."
    train(db, 'x')
    rid = load('x', db).id
    before = rows_of(db, rid)
    import torchember.store as S
    orig = S.metadata.sorted_tables
    boom = sa.Table('boom', sa.MetaData(), sa.Column('run_id', sa.Integer))   # not in the store: its delete fails
    monkeypatch.setattr(type(S.metadata), 'sorted_tables', property(lambda self: [boom, *orig]))
    with pytest.raises(sa.exc.OperationalError): torchember.delete_run('x', db)
    monkeypatch.undo()
    assert rows_of(db, rid) == before

def test_overwrite_replaces_a_run(db):
    train(db, 'baseline', steps=4)
    with pytest.raises(ValueError, match='already exists'): train(db, 'baseline')
    train(db, 'baseline', steps=2, overwrite=True)
    r = load('baseline', db)
    assert r.n_steps == 2 and r.scalars()['step'].max() == 1 and rows_of(db, r.id)['steps'] == 2 and len(runs(db)) == 1
    with pytest.raises(ValueError, match='overwrite'): torchEmber(tiny(), run='baseline', db=db, overwrite=True, resume=True)

def test_explore_opens_the_newest_run_with_steps(db):
    train(db, 'trained')
    te = torchEmber(tiny(), run='armed-not-stepped', db=db)
    e = torchember.explore(db)
    assert runs(db)['name'].iloc[0] == 'armed-not-stepped' and e.run.name == 'trained'
    e.close(); te.disarm()

def test_cli_ls_and_rm(db):
    train(db, 'a'); train(db, 'b')
    res = cli('ls', '--db', db)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ['name', 'model', 'steps', 'last_step'] and [l.split()[0] for l in lines[1:]] == ['b', 'a']
    assert lines[1].split()[1:4] == ['Sequential', '5', '4']
    res = cli('rm', 'a', '--db', db)
    assert res.returncode == 0 and res.stdout.startswith("deleted run 'a'"), res.stderr
    assert runs(db)['name'].tolist() == ['b']

# B. the command line

@pytest.mark.parametrize('args, says', [
    (['report', 'b', '--db', '{tmp}/missing.db'], 'no torchember store'),
    (['report', 'nope', '--db', '{db}'], "no run named 'nope'"),
    (['rm', 'nope', '--db', '{db}'], "no run named 'nope'"),
    (['rm', '--db', '{db}'], "give the run's name"),
    (['ls', '--db', '{tmp}'], 'is a directory'),
    (['report', 'b', '--db', '{db}', '-o', '{db}/x.html'], 'torchember report: '),   # a file where a folder should be
    ([], 'give a command'),
])
def test_cli_errors_are_one_line_and_status_2(db, tmp_path, args, says):
    train(db, 'b', steps=2)
    res = cli(*[a.format(db=db, tmp=tmp_path) for a in args], cwd=tmp_path)
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and 'Traceback' not in res.stderr, res.stderr

def test_cli_bad_argument_and_version(db):
    res = cli('report', 'b', '--db', db, '--max-points', 'many')   # argparse's own: its usage, then the error's line
    assert res.returncode == 2 and 'Traceback' not in res.stderr
    assert re.fullmatch(r".*: error: argument --max-points: invalid int value: 'many'", res.stderr.strip().splitlines()[-1])
    res = cli('--version')
    assert res.returncode == 0 and res.stdout.strip() == f'torchember {torchember.__version__}'

def test_cli_report_rank_and_report_argument_order(db, tmp_path):
    train(db, 'r', steps=3)
    res = cli('report', 'r', '--db', db, '-o', tmp_path/'r.html', '--rank', 0)
    assert res.returncode == 0 and Path(res.stdout.strip()) == (tmp_path/'r.html').resolve(), res.stderr
    assert torchember.report('r', tmp_path/'p.html', db) == (tmp_path/'p.html').resolve()
    assert torchember.report('r', path=tmp_path/'q.html', db=db).exists()
    assert load('r', db).report(tmp_path/'s.html').exists()

def test_demo_says_how_to_look_at_its_run(tmp_path):
    res = subprocess.run([sys.executable, '-m', 'torchember.demo', '--steps', '3', '--db', tmp_path/'d.db', '--run', 'demo'],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    tail = res.stdout.strip().splitlines()[-2:]
    assert f"torchember report demo --db {tmp_path/'d.db'} -o report.html" in tail[0]
    assert f"torchember.explore({str(tmp_path/'d.db')!r})" in tail[1]
    assert load('demo', tmp_path/'d.db').scalars()['name'].unique().tolist() == ['loss', 'lr']

from test_postgres import server, pg   # a fresh PostgreSQL store, or a skip that says why there is none

def test_delete_and_overwrite_on_postgres(pg):
    train(pg, 'keep', steps=2); train(pg, 'gone', steps=2)
    gid = load('gone', pg).id
    assert torchember.delete_run('gone', pg)['stats'] > 0 and set(rows_of(pg, gid).values()) == {0}
    train(pg, 'keep', steps=3, overwrite=True)
    assert runs(pg)[['name', 'steps']].values.tolist() == [['keep', 3]]
    with pytest.raises(KeyError, match="no run named 'gone'"): torchember.delete_run('gone', pg)
