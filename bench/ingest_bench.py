"""Ingest: stat rows a second into SQLite and PostgreSQL, for 1, 2 and 4 writing processes (`bench.py --ingest`).

Each writing process trains an armed fast MLP of its own run (16 x (Linear(64, 64), GELU), batch 32, every step
recorded, torch on one thread, the writer torchember chooses), all started together, for `secs` seconds, then
disarms (which waits for its writer to drain). Printed per store and number of processes: the stat rows stored a
second (all processes' rows, over the time from the first step to the last disarm's end), the steps each process ran
and how many of them its run holds, the steps dropped (`te.dropped`), the seconds each process's steps waited for
its writer (`Writer.paced`: a writer behind holds the run back, to at worst half its speed, before it drops), and the
longest disarm (the drain). The 1-minute load average is printed beside each row: on a shared machine it moves the
figures more than anything here.

PostgreSQL: the server of `$TORCHEMBER_PG_URL`, else a throwaway one started with `.ci/postgres` (skipped, saying
why, where none can start).
"""
import json, os, subprocess, sys, tempfile, time, uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = '''
import json, os, sys, time
import torch
from torch import nn
from torchember import torchEmber
db, run, secs, go = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(64, 64), nn.GELU())])
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(32, 64)
te = torchEmber(model, run=run, db=db)
model(x).pow(2).mean().backward(); opt.zero_grad()   # the run's first step (its graph captured, the writer started)
te.flush()
print('ready', flush=True)
while not os.path.exists(go): time.sleep(0.005)
t0, n = time.time(), 0
while time.time() - t0 < secs:
    model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    n += 1
t1 = time.time()
w = te.writer
te.disarm()
print(json.dumps(dict(paced=getattr(w, 'paced', 0.), ran=n + 1, t0=t0, t1=t1, t2=time.time(), dropped=te.dropped, writer='process' if te.writer_process else 'thread')), flush=True)
'''

def _stored(db:str, runs:list)->dict:
    "run -> (steps, stat rows) the store holds."
    import sqlalchemy as sa
    from torchember.store import engine
    with engine(db).connect() as c:
        q = sa.text("SELECT r.name, (SELECT COUNT(*) FROM steps s WHERE s.run_id = r.id), (SELECT COUNT(*) FROM stats s WHERE s.run_id = r.id) "
                    "FROM runs r WHERE r.name IN :names").bindparams(sa.bindparam('names', expanding=True))
        return {name: (steps, rows) for name, steps, rows in c.execute(q, dict(names=runs))}

def round_(db:str, n:int, secs:float, scratch:Path)->dict:
    "`n` processes trained together into store `db`: what they ran, stored and dropped, and the rows a second stored."
    go, tag = scratch/f'go-{uuid.uuid4().hex[:6]}', uuid.uuid4().hex[:6]
    runs = [f'ingest-{tag}-{i}' for i in range(n)]
    ps = [subprocess.Popen([sys.executable, '-c', WORKER, db, r, str(secs), str(go)], stdout=subprocess.PIPE, text=True,
                           stderr=subprocess.PIPE) for r in runs]
    for p in ps:
        line = p.stdout.readline()
        if line.strip() != 'ready': sys.exit(f"an ingest worker did not start: {line}{p.stderr.read()[-2000:]}")
    go.touch()
    got = []
    for p in ps:
        out, err = p.communicate(timeout=secs + 300)
        try: got.append(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError): sys.exit(f"an ingest worker failed:\n{err[-3000:]}")
    stored = _stored(db, runs)
    rows = sum(stored[r][1] for r in runs)
    span = max(g['t2'] for g in got) - min(g['t0'] for g in got)
    return dict(rows_s=rows / span, ran=[g['ran'] for g in got], stored=[stored[r][0] for r in runs],
                dropped=sum(g['dropped'] for g in got), paced=[g['paced'] for g in got], drain=max(g['t2'] - g['t1'] for g in got), writer=got[0]['writer'])

def _pg_url(scratch:Path):
    "`(url, folder to stop or None)`: `$TORCHEMBER_PG_URL`, else a throwaway server; `(None, why)` where there is none."
    if os.environ.get('TORCHEMBER_PG_URL'): return os.environ['TORCHEMBER_PG_URL'], None
    try: import psycopg  # noqa: F401
    except ImportError: return None, "psycopg is not installed (pip install 'torchember[postgres]')"
    folder = tempfile.mkdtemp(prefix='te-pg-')
    got = subprocess.run(['bash', str(HERE.parent/'.ci'/'postgres'), 'start', folder], capture_output=True, text=True)
    if got.returncode: return None, got.stderr.strip()[-300:]
    return got.stdout.strip(), folder

def main(secs:float=8, writers=(1, 2, 4)):
    scratch = Path(tempfile.mkdtemp(prefix='te-ingest-'))
    url, pg = _pg_url(scratch)
    stores = [('SQLite', lambda n: str(scratch/f'ingest-{n}.db'))]
    if url: stores.append(('PostgreSQL', lambda n: url))
    else: print(f"PostgreSQL skipped: {pg}")
    print(f"ingest: each process an armed 16 x (Linear(64), GELU) MLP, batch 32, every step, torch 1 thread, {secs:g} s; "
          "rows/s: stat rows stored a second, all processes, first step to last disarm\n")
    hdr = (f"{'store':<11} {'procs':>5} {'writer':>7} {'stat rows/s':>12} {'stored / ran, each process':<40} {'dropped':>7} "
           f"{'paced s, each':<24} {'drain s':>7} {'load':>5}")
    print(hdr); print('-' * len(hdr))
    try:
        for name, db in stores:
            for n in writers:
                r = round_(db(n), n, secs, scratch)
                each = ', '.join(f"{s:,}/{a:,}" for s, a in zip(r['stored'], r['ran']))
                paced = ', '.join(f"{p:.2f}" for p in r['paced'])
                load = os.getloadavg()[0]
                print(f"{name:<11} {n:5d} {r['writer']:>7} {r['rows_s']:12,.0f} {each:<40} {r['dropped']:7d} {paced:<24} "
                      f"{r['drain']:7.2f} {load:5.1f}", flush=True)
    finally:
        if pg: subprocess.run(['bash', str(HERE.parent/'.ci'/'postgres'), 'stop', pg], capture_output=True)

if __name__ == '__main__': main(float(sys.argv[1]) if len(sys.argv) > 1 else 8)
