"A stat is declared once (`kinds.STATS_REGISTRY`): one entry reaches `df()`, the views, `diff` and the CLI; absmax is right."
import json, math, os, sqlite3, subprocess, sys, textwrap, warnings
import pytest, torch
from plugins import run_with_plugin
from torchember.kinds import merge_stats, stat_names, STATS_REGISTRY
from torchember.stats import default_stats, STATS

PLUGIN = '''
import math
from torchember.kinds import register_stat, Stat
def _rms_merge(vs, ks, ps): return math.sqrt(sum(k * v * v for v, k in zip(vs, ks)) / sum(ks)) if ks else math.nan
register_stat(Stat('rms', lambda m, xp: xp.sqrt(m.sumsq / m.n), _rms_merge, "root mean square"))
'''

SCRIPT = '''
import json, sqlite3, sys, torch
from torch import nn
import torchember as te
from torchember.diagnose import diff
db = sys.argv[1]
for name, scale in (('a', 1.), ('b', 2.)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with te.torchEmber(model, run=name, db=db) as t:
        for _ in range(3): model(torch.randn(16, 4) * scale).pow(2).mean().backward()
    df = te.load(name, db).df()
w = model[0].weight.detach()
row = df[(df.module == '0') & (df.ttype == 'weight') & (df.tname == 'weight') & (df.step == df.step.max())].iloc[0]
latest = sqlite3.connect(db).execute("SELECT COUNT(rms) FROM latest WHERE run = 'b'").fetchone()[0]
d = diff('a', 'b', db=db)
print(json.dumps(dict(cols=list(df.columns), rms=float(row['rms']), want=float(w.pow(2).mean().sqrt()),
                      latest=latest, diffed=sorted(set(d['stat'])))))
'''

def _run(tmp_path, *args, plugin=True): return run_with_plugin(tmp_path, 'rms_stat', PLUGIN, 'TORCHEMBER_STATS', *args, plugin=plugin)

def test_a_stat_declared_once_reaches_df_views_diff_and_cli(tmp_path):
    db = str(tmp_path/'s.db')
    (tmp_path/'go.py').write_text(SCRIPT)
    p = _run(tmp_path, 'go.py', db)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert 'rms' in got['cols']                                     # df()
    assert math.isclose(got['rms'], got['want'], rel_tol=1e-6)     # derived from the moments, as torch has it
    assert got['latest'] > 0                                        # the views
    assert 'rms' in got['diffed']                                   # diagnose's diff compares it
    cli = _run(tmp_path, '-m', 'torchember.cli', 'diff', 'a', 'b', '--db', db)
    assert 'rms' in cli.stdout, (cli.stdout[-2000:], cli.stderr[-2000:])   # the command line
    plain = _run(tmp_path, '-c', 'import torchember as te, sys; print(list(te.load("a", sys.argv[1]).df().columns))', db,
                 plugin=False)
    assert plain.returncode == 0 and 'rms' not in plain.stdout      # undeclared: no column (the test can fail)

def test_registry_derives_the_public_names():
    from torchember.store import STAT_COLS, VIEWS
    from torchember.figures import MAP_STATS, _ORDER
    from torchember.diagnose import COMPARED
    assert STATS == STAT_COLS == tuple(COMPARED) == stat_names() == tuple(STATS_REGISTRY)
    assert 'absmax' in STATS and 's.absmax' in VIEWS['records']
    assert set(_ORDER) == set(STATS) and _ORDER[0] == 'mean' and _ORDER[-1] == 'numel'
    assert set(MAP_STATS) == {'norm', 'std', 'mean', 'max', 'min', 'zero_frac'}

def _absmax(t): return t.abs().max().item()

@pytest.mark.parametrize('t', [torch.randn(1000) * 3 - 5, torch.randn(70_000) + 2, torch.tensor([-7., 2., 3.]),
                               torch.randn(64, 64).half(), torch.randn(33).bfloat16(), torch.tensor([0.5])])
def test_absmax_is_torchs(t):
    assert default_stats(t)['absmax'].item() == _absmax(t.double())

def test_absmax_of_nan_is_nan():
    assert math.isnan(default_stats(torch.tensor([1., float('nan'), -3.]))['absmax'].item())

def test_absmax_merges_across_shards():
    x = torch.cat([torch.randn(100), torch.tensor([-40.]), torch.randn(50) * 3, torch.tensor([12.])]).double()
    pieces = [x[:60], x[60:60], x[60:130], x[130:]]                # an empty piece adds nothing
    parts = [tuple(float(v) if p.numel() else math.nan for v in default_stats(p).values()) if p.numel()
             else (0.,) + (math.nan,) * (len(STATS) - 1) for p in pieces]
    whole = merge_stats(parts)
    want = {k: float(v) for k, v in default_stats(x).items()}
    got = dict(zip(STATS, whole))
    assert got['absmax'] == 40. == want['absmax']
    for k in STATS: assert math.isclose(got[k], want[k], rel_tol=1e-9, abs_tol=1e-12), k
    assert math.isnan(dict(zip(STATS, merge_stats([parts[0], parts[2][:9] + (math.nan,)])))['absmax'])

def old_views()->dict:
    "The views as a schema-2 store has them: no absmax."
    from torchember import store
    return {k: v.replace(', ' + store._stat_sql('absmax'), '') for k, v in store.VIEWS.items()}

def test_a_store_made_before_absmax_reads_it_without_rewriting_a_row(tmp_path):
    "An older store gains the column at once (no pass over its rows); reads fill absmax in from min and max."
    import torchember as te
    from torch import nn
    from torchember import store
    db = str(tmp_path/'old.db')
    model = nn.Linear(3, 2)
    with te.torchEmber(model, run='old', db=db):
        for _ in range(2): model(torch.randn(5, 3) - 4).sum().backward()
    with sqlite3.connect(db) as c:   # as schema 2 left it: no absmax column, views without it
        for v in reversed(store.VIEWS): c.execute(f'DROP VIEW IF EXISTS {v}')
        c.execute('DROP INDEX IF EXISTS stats_nonfinite')
        c.execute('ALTER TABLE stats DROP COLUMN absmax')
        c.execute('ALTER TABLE shards DROP COLUMN absmax')
        for k, q in old_views().items(): c.execute(f'CREATE VIEW {k} AS {q}')
        c.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    store._engines.clear(); store._opened.clear()
    df = te.load('old', db).df()
    assert df['absmax'].notna().all()
    assert (df['absmax'] == df[['min', 'max']].abs().max(axis=1)).all()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(store.SCHEMA_VERSION),)
        assert c.execute('SELECT COUNT(*) FROM stats WHERE absmax IS NOT NULL').fetchone() == (0,)   # no row rewritten
        view = c.execute('SELECT absmax, min, max FROM latest').fetchall()
    assert view and all(a == max(abs(lo), abs(hi)) for a, lo, hi in view)
