"""Sharded training (issue 26): two CPU ranks (gloo), each setup trained bare and armed by `sharded_worker.py`.

Setups: FSDP2 (per block and the root), FSDP2 with activation checkpointing (`checkpoint_wrapper`), FSDP1 with
`use_orig_params` False and True, tensor parallel (colwise + rowwise), 2-D (FSDP2 over a data-parallel dimension of 1
with tensor parallel over 2) and HSDP (2 replicas of a 1-way shard, so each piece is held twice).
Checked for each: training stays bit-identical; names and types are the user's; every parameter has one weight and one
weight_grad row per rank and step, with its full shape, whose stats equal those of the gathered tensor at every recorded
step; `ranks=[0]` on a sharded model is refused at arm time on every rank, and the job ends (never hangs).
"""
import json, math, os, socket, subprocess, sys
from pathlib import Path
import pytest, torch
from torchember import load
from torchember.stats import STATS

SETUPS = ('fsdp2', 'fsdp2_ac', 'fsdp1', 'fsdp1_orig', 'tp', '2d', 'hsdp')
WORKER = Path(__file__).parent/'sharded_worker.py'

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def run_job(db:str, out:Path, setups=SETUPS, worker:Path=WORKER)->list:
    "Run the two ranks of `worker` (`sharded_worker.py`) over `setups` into store `db`; each rank's results."
    env = {**os.environ, 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(free_port()), 'WORLD_SIZE': '2',
           'TORCHEMBER_COMPILE': '0', 'OMP_NUM_THREADS': '1'}
    if sys.platform == 'linux': env.setdefault('GLOO_SOCKET_IFNAME', 'lo')
    ps = [subprocess.Popen([sys.executable, str(worker), db, str(out), ','.join(setups)], env={**env, 'RANK': str(r)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    failed = []
    try:
        for r, p in enumerate(ps):
            _, err = p.communicate(timeout=300)           # a hang (a collective only one rank makes) fails here
            if p.returncode: failed.append(f'rank {r} exited with {p.returncode}:\n{err[-3000:]}')
    finally:
        for p in ps:
            if p.poll() is None: p.kill()
    assert not failed, '\n'.join(failed)
    return [json.loads(Path(f'{out}.{r}.json').read_text()) for r in range(2)]

@pytest.fixture(scope='module')
def job(tmp_path_factory):
    "One two-rank job over every setup: the store and each rank's results."
    pytest.importorskip('torch.distributed.fsdp')
    if not torch.distributed.is_available(): pytest.skip('torch.distributed is not available')
    tmp = tmp_path_factory.mktemp('sharded')
    db = str(tmp/'store.db')
    return db, run_job(db, tmp/'result')

def full_name(module:str, tname:str)->str: return f'{module}.{tname}' if module else tname

def same(got, want)->bool:
    if want is None or (isinstance(want, float) and math.isnan(want)): return got is None or math.isnan(got)
    return got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)

@pytest.mark.parametrize('setup', SETUPS)
def test_training_is_bit_identical(job, setup):
    _, res = job
    for r in res: assert r[setup]['armed'] == r[setup]['bare']

@pytest.mark.parametrize('setup', SETUPS)
def test_names_and_types_are_the_users(job, setup):
    db, res = job
    run = load(setup, db)
    mods = run.modules()
    assert run.model == ('MLP' if setup in ('tp', '2d') else 'Net')
    assert not any(t.startswith(('FSDP', 'FullySharded', 'Checkpoint')) for t in mods['mtype'])
    assert not any(w in n for n in mods['module'] for w in ('_fsdp_wrapped_module', '_checkpoint_wrapped_module', '_orig_mod'))
    if setup not in ('tp', '2d'):
        types = dict(zip(mods['module'], mods['mtype']))
        assert (types['blocks.0'], types['blocks.1.fc2'], types['norm']) == ('Block', 'Linear', 'LayerNorm')
    assert not any('flat_param' in t for t in run.df(step=0)['tname'])

def check_whole(db, res:list, setup:str, steps=(0, 1, 2)):
    "Every parameter and grad of `setup`, every recorded step (`steps`), on both ranks: one row with its full shape and the gathered tensor's stats."
    df = load(setup, db).df()
    ref = res[0][setup]['ref']
    assert len(ref) == 3 and sorted(set(df.step)) == list(steps)
    for step in steps:
        want = ref[step]
        for ttype in ('weight', 'weight_grad'):
            got = df[(df['step'] == step) & (df['ttype'] == ttype)]
            assert sorted(set(got.apply(lambda r: full_name(r['module'], r['tname']), axis=1))) == sorted(want[ttype])
            for _, row in got.iterrows():
                stats = want[ttype][full_name(row['module'], row['tname'])]
                assert row['numel'] == stats[0] == math.prod(row['shape'])
                bad = {k: (row[k], v) for k, v in zip(STATS, stats) if not same(row[k], v)}
                assert not bad, (step, ttype, row['module'], row['tname'], row['rank'], bad)
            assert all(v == [0, 1] for v in got.groupby(['module', 'tname'])['rank'].apply(sorted))

@pytest.mark.parametrize('setup', SETUPS)
def test_whole_parameters_equal_the_gathered_tensors(job, setup):
    db, res = job
    check_whole(db, res, setup)

def test_latest_and_summary_read_whole_parameters(job):
    db, res = job
    run = load('fsdp2', db)
    w = run.latest().query("ttype == 'weight'")
    assert (w['shape'].apply(math.prod) == w['numel']).all()
    assert w.query("module == 'out' and tname == 'weight'")['numel'].tolist() == [5, 5]   # rank 1's piece was empty
    s = run.summary()
    assert s.loc[s['module'] == 'head', 'weight_norm'].notna().all()

def test_merged_extras_and_pieces_of_what_cannot_merge(job):
    "`track_updates`: norms merge exactly; `hist`: the whole's default stats, the histogram per piece; a stat without a count: per rank."
    db, res = job
    run = load('fsdp2-custom', db)
    df = run.df()
    ref = res[0]['fsdp2-custom']['ref']
    for step, want in enumerate(ref):
        w = df[(df['step'] == step) & (df['ttype'] == 'weight')]
        for _, row in w.iterrows():
            stats = want['weight'][full_name(row['module'], row['tname'])]
            assert all(same(row[k], v) for k, v in zip(STATS, stats[:len(STATS)]))
            assert same(row['update_norm'], stats[-1]), (step, row['module'], row['tname'], row['update_norm'], stats[-1])
    g = df[df['ttype'] == 'weight_grad']
    assert g['numel'].isna().all() and g[g['shape'].apply(math.prod) > 0]['mean'].notna().all()   # mean_norm's own, per piece
    inp = g[(g['module'] == 'inp') & (g['tname'] == 'weight')]
    assert sorted(map(tuple, inp['shape'])) == [(3, 3)] * 6                        # each rank's half of (6, 3), 3 steps
    from torchember.store import engine
    with engine(db).connect() as c:
        hists = c.exec_driver_sql("SELECT extra FROM shards s JOIN runs r ON r.id = s.run_id "
                                  "WHERE r.name = 'fsdp2-custom' AND ttype = 'weight'").scalars().all()
    assert hists and all('hist' in json.loads(h) for h in hists)

def test_rank_0_alone_is_refused_on_every_rank(job):
    _, res = job
    for r in res:
        for setup, msg in r['refused'].items():
            assert 'sharded' in msg and 'every rank' in msg, (setup, msg)

def test_a_trainers_callback_records_every_rank_of_a_sharded_model(job):
    db, res = job
    assert [r['callback'][1] for r in res] == [0, 1] and res[0]['callback'][0] == res[1]['callback'][0]
    run = load(res[0]['callback'][0], db)
    w = run.df(ttype='weight')
    assert run.ranks == [0, 1] and len(w) and (w['shape'].apply(math.prod) == w['numel']).all()

def test_one_rank_armed_by_hand_is_told_and_keeps_its_pieces(job):
    db, res = job
    assert any('1 of 2 ranks' in m and 'shards' in m for m in res[0]['lone']), res[0]['lone']
    run = load('fsdp2-lone', db)
    assert run.df(ttype='weight').empty   # no half parameters: a step merges once every rank of the job has written it
    assert len(run.df(ttype='output'))   # activations as ever
    from torchember.store import engine
    with engine(db).connect() as c:
        n = c.exec_driver_sql("SELECT COUNT(*) FROM shards s JOIN runs r ON r.id = s.run_id WHERE r.name = 'fsdp2-lone'").scalar()
    assert n > 0

def test_parameters_partitioned_away_are_said_once_not_recorded():
    "A DeepSpeed ZeRO-3 parameter holds nothing between steps: one warning, no empty rows."
    import warnings
    from torch import nn
    from torchember import torchEmber
    class Partitioned(nn.Module):     # `b` is gathered for its own forward only, which this step does not make
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 3), nn.Linear(3, 1)
            for p in self.b.parameters(): p.data, p.ds_numel = torch.empty(0), p.numel()
        def forward(self, x): return self.a(x)
    m = Partitioned()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        te = torchEmber(m, db=':memory:')
        for _ in range(3): m(torch.randn(4, 2)).sum().backward()
    msgs = [str(w.message) for w in said if 'partitioned away' in str(w.message)]
    assert len(msgs) == 1 and 'b.weight' in msgs[0]
    te.disarm()
    w = te.df(ttype='weight')
    assert set(w['module']) == {'a'} and len(w) == 6

def test_fsdp1_fsdp2_and_hsdp_record_the_same_run(job):
    "The same model and batches sharded three ways train alike; their whole parameters' stats agree to float rounding."
    from torchember.diagnose import diff
    db, res = job
    assert res[0]['fsdp2']['armed'] == res[0]['fsdp1']['armed'] == res[0]['hsdp']['armed']
    for other in ('fsdp1', 'fsdp1_orig', 'hsdp'):
        d = diff('fsdp2', other, db, rtol=1e-9)
        assert d.empty, (other, d.head())

def test_the_report_shows_the_users_model(job):
    from torchember.report import report_html
    db, _ = job
    page = report_html(load('fsdp2', db))
    assert 'blocks.0.fc1' in page and 'FSDPBlock' not in page and '_flat_param' not in page
