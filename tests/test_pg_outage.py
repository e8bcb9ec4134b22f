"""A PostgreSQL server that goes away while a run writes to it (issue 47): stopped (`pg_ctl -m fast`) or crashed
(`-m immediate`), then started again a few seconds later.

Each test starts a throwaway server of its own with `.ci/postgres` (skipped, saying why, where none can start), trains
an armed MLP into it in a subprocess, takes the server away, brings it back and lets the training end. The training
never stalls or raises; the steps finished while the server was away wait in memory and are written once it is back,
with one warning as it goes and one as it comes back; nothing is lost, the run is found by its name, and the process
exits normally. `.ci/postgres` runs the server with `synchronous_commit=off` and `fsync=off`, as a test server may:
the store asks for synchronous commits on its own connections, so that a crash loses no step it was told is written.
"""
import os, shutil, subprocess, sys, tempfile, textwrap, threading, time
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
CI_PG = ROOT/'.ci'/'postgres'

TRAIN = textwrap.dedent('''
    import os, sys, time, warnings
    import torch
    from torch import nn
    from torchember import torchEmber
    db, stop = sys.argv[1], sys.argv[2]
    warnings.simplefilter('always')
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    te = torchEmber(model, run='outage', db=db)
    step = 0
    while not os.path.exists(stop):
        model(torch.randn(16, 32)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        print(step, time.time(), flush=True)
        step += 1
        time.sleep(0.005)
    te.disarm()
    print('dropped', te.dropped, flush=True)
''')

def _bindir()->str|None:
    "The newest installed server's bin folder, as `.ci/postgres` finds it."
    found = sorted(Path('/usr/lib/postgresql').glob('*/bin'), key=lambda p: [int(x) for x in p.parent.name.split('.') if x.isdigit()])
    if found: return str(found[-1])
    ctl = shutil.which('pg_ctl')
    return str(Path(ctl).resolve().parent) if ctl else None

def _as_server(*cmd):
    "Run `cmd` as `.ci/postgres` runs the server: as the `postgres` user where this is root."
    return subprocess.run((['runuser', '-u', 'postgres', '--'] if os.getuid() == 0 else []) + list(cmd),
                          capture_output=True, text=True, timeout=120)

@pytest.fixture
def server():
    "`(url, folder)` of a throwaway server of this test's own, started by `.ci/postgres`; stopped and deleted after."
    pytest.importorskip('psycopg', reason="psycopg is not installed: pip install 'torchember[postgres]'")
    folder = tempfile.mkdtemp(prefix='te-pg-')   # short: the server's socket lives in it
    got = subprocess.run(['bash', str(CI_PG), 'start', folder], capture_output=True, text=True, timeout=300)
    if got.returncode != 0 or not _bindir():
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"no throwaway PostgreSQL server: {got.stderr.strip()[-300:]}")
    yield got.stdout.strip(), folder
    subprocess.run(['bash', str(CI_PG), 'stop', folder], capture_output=True, timeout=120)

def _pg_ctl(folder:str, *args):
    got = _as_server(f'{_bindir()}/pg_ctl', '-D', f'{folder}/data', *args)
    assert got.returncode == 0, got.stdout + got.stderr

def _stop(folder:str, mode:str): _pg_ctl(folder, '-m', mode, '-w', 'stop')

def _start(folder:str):   # as `.ci/postgres` starts it
    _pg_ctl(folder, '-l', f'{folder}/server.log', '-w', '-t', '60', '-o',
            f"-c listen_addresses='' -k {folder} -c fsync=off -c synchronous_commit=off -c full_page_writes=off", 'start')

class Lines:
    "The step lines a training subprocess prints, `{step: time}`, read on a thread as they come."
    def __init__(self, p):
        self.steps, self.other = {}, []
        self.t = threading.Thread(target=self._read, args=(p,), daemon=True)
        self.t.start()
    def _read(self, p):
        for line in p.stdout:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit(): self.steps[int(parts[0])] = float(parts[1])
            else: self.other.append(line)
    def wait_for(self, n:int, limit:float=120):
        end = time.time() + limit
        while len(self.steps) < n and time.time() < end: time.sleep(0.05)
        assert len(self.steps) >= n, f"only {len(self.steps)} steps in {limit} s"

def _stored(url:str)->set:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            return set(c.exec_driver_sql("SELECT s.step FROM steps s JOIN runs r ON r.id = s.run_id WHERE r.name = 'outage'").scalars())
    finally: eng.dispose()

@pytest.mark.parametrize('writer', ['thread', 'process'])
@pytest.mark.parametrize('mode', ['fast', 'immediate'])
def test_a_server_that_goes_away_loses_nothing(server, tmp_path, mode, writer):
    url, folder = server
    script, stop = tmp_path/'train.py', tmp_path/'stop'
    script.write_text(TRAIN)
    env = {**os.environ, 'TORCHEMBER_WRITER': writer}
    p = subprocess.Popen([sys.executable, str(script), url, str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    err = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    lines, failed = Lines(p), None
    try:
        lines.wait_for(60)
        time.sleep(1.5)   # steps finished over a second before the outage
        went = time.time()
        _stop(folder, mode)
        time.sleep(3)
        back = time.time()
        _start(folder)
        n = len(lines.steps)
        lines.wait_for(n + 60)   # and steps after it
        time.sleep(1)
    except AssertionError as e: failed = e
    finally:
        stop.touch()
        try: p.wait(120)
        except subprocess.TimeoutExpired: p.kill()
        lines.t.join(10)
    said = ''.join(err)
    assert failed is None, f"{failed}\n{said[-3000:]}"
    assert p.returncode == 0, said[-3000:]
    assert 'Traceback' not in said, said[-3000:]
    steps = lines.steps
    during = [s for s, t in steps.items() if went + 0.5 < t < back]
    assert during, "the training stalled while the server was away"
    stored = _stored(url)   # found by the run's name
    old = {s for s, t in steps.items() if s + 1 in steps and steps[s + 1] < went - 1.0}
    assert len(old) > 20 and not old - stored, f"{len(old - stored)} steps finished over 1 s before the outage are lost"
    assert set(steps) - stored == set(), (f"steps not written once the server was back: {sorted(set(steps) - stored)[:20]}"
                                        f"\n{said[-3000:]}")
    assert [l.split()[1] for l in lines.other if l.startswith('dropped')] == ['0']
    assert said.count('cannot be reached') == 1 and said.count('is back after') == 1, said[-3000:]
