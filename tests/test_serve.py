"""`torchember serve` in a real browser: the command serves the explorer with Voilà on a store that a training
subprocess is writing; headless Chromium (the system's, driven by Playwright, as in test_browser.py) opens the URL the
command printed, picks a run whose name (and module name) is crafted markup, which must show as text, picks the
training run, clicks a cell of the model map and sees that module's history, and sees new steps arrive without a
reload. The command refuses, in one line on stderr, a non-local address without a token, a store that isn't there, a
database that isn't a torchember store and a port in use; with a token, Voilà turns away a browser without it.
Screenshots go to test-artifacts/serve-*.png.

The browser test needs `chromium` (/usr/bin/chromium) and `playwright` (`.ci/browser-deps`), and `voila`
(`pip install -e ".[serve]"`); skipped, saying why, when one is missing."""
import os, re, signal, socket, sqlite3, subprocess, sys, time, urllib.error, urllib.request
from collections import OrderedDict
from pathlib import Path
import pytest

CHROMIUM = os.environ.get('TORCHEMBER_CHROMIUM', '/usr/bin/chromium')
ARGS = ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
        '--disable-background-networking', '--disable-component-update', '--disable-sync']
ARTIFACTS = Path(__file__).resolve().parent.parent/'test-artifacts'
WAIT_MS = 120_000
XSS_RUN, XSS_MODULE = '<img src=x onerror=alert(1)>', '<img src=y onerror=alert(2)>'

try: from playwright.sync_api import sync_playwright
except ImportError: sync_playwright = None
try: import voila
except ImportError: voila = None

needs_voila = pytest.mark.skipif(voila is None, reason='voila is not installed: pip install -e ".[serve]"')
needs_browser = [
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: run .ci/browser-deps (pip install playwright)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no chromium at {CHROMIUM}: run .ci/browser-deps (apt-get install chromium)"),
]

TRAINER = """import sys, time, torch
from torch import nn
from torchember import torchEmber
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with torchEmber(model, run='mlp', db=sys.argv[1]) as te:
    for step in range(int(sys.argv[2])):
        x = torch.rand(32, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        te.log(loss=loss)
        time.sleep(0.1)   # a little slower than bare: the page must see steps arrive
"""

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def cli(*args, timeout=120)->subprocess.CompletedProcess:
    "Run `torchember ARGS` to its end."
    return subprocess.run([sys.executable, '-m', 'torchember.cli', *args], capture_output=True, text=True, timeout=timeout)

def start(args:list, log:Path)->subprocess.Popen:
    "Start `torchember ARGS` in a session of its own, stdout and stderr to `log`."
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'JUPYTER_RUNTIME_DIR': str(log.parent/'runtime')}
    return subprocess.Popen([sys.executable, '-m', 'torchember.cli', *args], stdout=open(log, 'w'), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)

def stop(proc:subprocess.Popen):
    "End `proc` and its children (Voilà's kernels)."
    try: os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError: return
    try: proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)

def printed_url(proc, log:Path, timeout:float=120)->str:
    "The URL `torchember serve` printed, once the server behind it answers."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None: pytest.fail(f"torchember serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        m = re.search(r'torchember serve: (http://\S+)', log.read_text())
        if m:
            try:
                with urllib.request.urlopen(m[1].split('?')[0] + 'voila/static/', timeout=2): pass
            except urllib.error.HTTPError: return m[1]    # the server answers (a 404 or 403 is an answer)
            except OSError: pass
            else: return m[1]
        time.sleep(0.25)
    pytest.fail(f"torchember serve did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")

def steps_in(db:Path, run:str)->int:
    "Steps of `run` in store `db` so far (0 while it has none)."
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return c.execute("SELECT count(*) FROM steps JOIN runs ON runs.id = steps.run_id WHERE runs.name = ?", (run,)).fetchone()[0]
    except sqlite3.Error: return 0

@pytest.fixture
def store(tmp_path):
    "A store with a run whose name and module name are markup, then a run `mlp` a subprocess is training into it."
    import torch
    from torch import nn
    from torchember import torchEmber
    db = tmp_path/'store.db'
    m = nn.Sequential(OrderedDict([(XSS_MODULE, nn.Linear(2, 2))]))
    with torchEmber(m, run=XSS_RUN, db=db):
        for _ in range(3): m(torch.randn(4, 2)).sum().backward()
    (tmp_path/'train.py').write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(tmp_path/'train.py'), str(db), '3000'], start_new_session=True,
                               stdout=open(tmp_path/'train.log', 'w'), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while steps_in(db, 'mlp') < 3:
            assert trainer.poll() is None, (tmp_path/'train.log').read_text()
            assert time.monotonic() < deadline, 'the trainer wrote no steps'
            time.sleep(0.2)
        yield db
    finally: stop(trainer)

from test_browser import MAP_CELL, STATUS, TITLES   # the explorer's page probes, shared with the Jupyter test
RUN_OPTIONS = ("[...([...document.querySelectorAll('.widget-dropdown')].find(d => (d.querySelector('label') || {}).textContent == 'run')"
               "?.querySelectorAll('select option') || [])].map(o => o.textContent)")
TO_TOP = "() => { window.scrollTo(0, 0); document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; }); }"
N_STEPS = f"(() => {{ const m = /· (\\d+) steps?/.exec({STATUS}); return m ? +m[1] : 0; }})()"

def pick_run(page, name:str):
    "Pick run `name` in the run picker (its label also counts the run's steps, which grow)."
    for attempt in range(5):
        label = next((o for o in page.evaluate(f"() => {RUN_OPTIONS}") if o.replace('\xa0', ' ').startswith(name + ' · ')), None)
        assert label is not None, page.evaluate(f"() => {RUN_OPTIONS}")
        try: return page.select_option('.widget-dropdown:has(label:text-is("run")) select', label=label, timeout=5_000)
        except Exception:
            if attempt == 4: raise

@needs_voila
@needs_browser[0]
@needs_browser[1]
def test_serve_in_a_browser(store, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    log = tmp_path/'serve.log'
    server = start(['serve', '--db', str(store), '--port', str(free_port())], log)
    try:
        url = printed_url(server, log)
        assert url.startswith('http://127.0.0.1:')
        assert 'ssh -L' in log.read_text()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page, errors, dialogs = browser.new_page(viewport={'width': 1500, 'height': 1500}), [], []
            page.on('pageerror', lambda e: errors.append(str(e)))
            page.on('dialog', lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(url, timeout=WAIT_MS)
            # the newest run with steps, the one training, is shown, its map drawn
            page.wait_for_function(f"() => {RUN_OPTIONS}.length == 2 && document.querySelectorAll('.js-plotly-plot .heatmaplayer image').length > 0"
                                   f" && {STATUS}.includes(' · live')", timeout=WAIT_MS)
            assert any(o.replace('\xa0', ' ').startswith('mlp · Sequential · ') for o in page.evaluate(f"() => {RUN_OPTIONS}"))

            # the crafted run: its name and its module's show as text; no image is made of them, no script runs
            pick_run(page, XSS_RUN)
            page.wait_for_function("(m) => [...document.querySelectorAll('.widget-select select option')].some(o => o.textContent.replace(/\u00a0/g, ' ').includes(m))",
                                   arg=XSS_MODULE, timeout=60_000)
            page.wait_for_function(f"() => {TITLES}.some(t => t.includes('{XSS_RUN}: log10'))", timeout=60_000)
            page.wait_for_timeout(3000)
            assert page.locator('img[src="x"], img[src="y"]').count() == 0
            assert dialogs == []
            assert XSS_RUN in page.locator('.widget-dropdown:has(label:text-is("run")) select').inner_text().replace('\xa0', ' ')
            page.screenshot(path=str(ARTIFACTS/'serve-crafted-names.png'))

            # the training run: a click on a cell of its map opens that module's history, the step marked
            pick_run(page, 'mlp')
            page.wait_for_function(f"() => {TITLES}.some(t => t.includes('every module')) && !{TITLES}.some(t => t.includes('{XSS_MODULE}'))",
                                   timeout=60_000)
            page.wait_for_timeout(1500)
            for attempt in range(3):
                x, y, label = page.evaluate(MAP_CELL, [2, 1])
                page.mouse.click(x, y)
                try:
                    page.wait_for_function(f"() => {TITLES}.some(t => /over (applied )?steps · step 2 marked/.test(t))", timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            title = next(t for t in page.evaluate(f"() => {TITLES}") if 'step 2 marked' in t)
            picked = page.evaluate("() => [...document.querySelectorAll('.widget-select select option')].filter(o => o.selected)"
                                   ".map(o => o.textContent.replace(/\\u00a0/g, ' ').trim())")
            assert any(title.startswith(m.split(':')[0] + ' · ') for m in picked), (title, picked)   # the cell's module, picked
            page.wait_for_timeout(500)
            page.evaluate(TO_TOP)
            page.screenshot(path=str(ARTIFACTS/'serve-map-click.png'), full_page=True)

            # a second viewer at once, in a kernel of its own: it shows the training run too
            other = browser.new_page(viewport={'width': 1500, 'height': 1000})
            other.on('pageerror', lambda e: errors.append(str(e)))
            other.goto(url, timeout=WAIT_MS)
            other.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .heatmaplayer image').length > 0"
                                    f" && {STATUS}.includes(' · live')", timeout=WAIT_MS)

            # new steps arrive without a reload, on both pages: the status line's count grows
            n0, m0 = page.evaluate(N_STEPS), other.evaluate(N_STEPS)
            assert n0 > 0 and m0 > 0
            page.wait_for_function(f"() => {N_STEPS} > {n0}", timeout=60_000)
            page.wait_for_function(f"() => {N_STEPS} > {n0} + 3", timeout=60_000)
            other.wait_for_function(f"() => {N_STEPS} > {m0} + 3", timeout=60_000)
            assert steps_in(store, 'mlp') >= page.evaluate(N_STEPS)
            page.evaluate(TO_TOP)
            page.screenshot(path=str(ARTIFACTS/'serve-live.png'), full_page=True)
            assert errors == [], errors
            browser.close()
    except BaseException:
        for name in ('page', 'other'):   # what the viewers showed when it failed
            try: locals()[name].screenshot(path=str(ARTIFACTS/f'serve-failed-{name}.png'), timeout=10_000)
            except Exception: pass
        print(log.read_text()[-3000:])
        raise
    finally: stop(server)
    assert 'readonly' not in log.read_text()

@needs_voila
def test_serve_refuses_in_one_line(tmp_path):
    "What `torchember serve` refuses, each in one line, before anything is served; from a shell on stderr, status 2."
    import torch
    from torch import nn
    from fastcore.script import CliError
    from torchember import torchEmber
    from torchember.cli import main
    db = tmp_path/'store.db'
    m = nn.Linear(2, 2)
    with torchEmber(m, run='a', db=db): m(torch.randn(3, 2)).sum().backward()
    sqlite3.connect(tmp_path/'other.db').execute('CREATE TABLE t (x)')
    (tmp_path/'notes.txt').write_text('not a database')
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0)); busy.listen()
        cases = {'--host 0.0.0.0': (dict(db=str(db), host='0.0.0.0'), 'refusing to listen on 0.0.0.0 without a token'),
                 'no store': (dict(db=str(tmp_path/'missing.db')), 'there is no torchember store at'),
                 'not a store': (dict(db=str(tmp_path/'other.db')), 'is a database but not a torchember store'),
                 'not a database': (dict(db=str(tmp_path/'notes.txt')), 'is not a readable torchember store'),
                 'port in use': (dict(db=str(db), port=busy.getsockname()[1]), 'is in use')}
        for what, (kw, says) in cases.items():
            with pytest.raises(CliError) as e: main('serve', **kw)
            msg = str(e.value)
            assert msg.startswith('torchember serve: ') and says in msg and '\n' not in msg, (what, msg)
    assert not (tmp_path/'missing.db').exists()   # serving a missing store does not create it
    assert len(set(sqlite3.connect(tmp_path/'other.db').execute("SELECT name FROM sqlite_master")) ) == 1   # nor touches another's
    r = cli('serve', '--db', str(db), '--host', '0.0.0.0')   # from a shell: one line on stderr, status 2, no URL
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'ssh -L' in r.stderr and 'http://' not in r.stdout, (r.stdout, r.stderr)

@needs_voila
def test_serve_with_a_token(tmp_path):
    "On another address, with a token: the URL printed carries it, and a browser without it is turned away."
    import torch
    from torch import nn
    from torchember import torchEmber
    db = tmp_path/'store.db'
    m = nn.Linear(2, 2)
    with torchEmber(m, run='a', db=db): m(torch.randn(3, 2)).sum().backward()
    log = tmp_path/'serve.log'
    port = free_port()
    server = start(['serve', '--db', str(db), '--host', '0.0.0.0', '--port', str(port), '--token', 'auto'], log)
    try:
        url = printed_url(server, log)
        token = re.search(r'\?token=([\w-]{20,})$', url)[1]
        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *a, **k): return None
        opener = urllib.request.build_opener(NoRedirect)
        for bad in ('', '?token=wrong'):
            with pytest.raises(urllib.error.HTTPError) as e: opener.open(f'http://127.0.0.1:{port}/{bad}', timeout=30)
            assert e.value.code in (302, 401, 403), e.value.code
            assert 'login' in (e.value.headers.get('Location') or 'login')
    finally: stop(server)

@pytest.mark.skipif(not os.environ.get('TORCHEMBER_PG_URL'), reason="TORCHEMBER_PG_URL is not set (bash .ci/postgres start DIR prints one)")
def test_serve_reads_postgres_read_only():
    "On a PostgreSQL store, a viewer's engine reads the runs and cannot write: its transactions are read-only."
    import uuid, torch, sqlalchemy as sa
    from torch import nn
    from torchember import torchEmber
    from torchember.serve import read_only_engine, app
    url, run = os.environ['TORCHEMBER_PG_URL'], f'serve-{uuid.uuid4().hex[:8]}'
    m = nn.Linear(2, 2)
    with torchEmber(m, run=run, db=url):
        for _ in range(3): m(torch.randn(2, 2)).sum().backward()
    ro = read_only_engine(url)
    with ro.connect() as c: assert run in c.execute(sa.text('SELECT name FROM runs')).scalars().all()
    with pytest.raises(sa.exc.DBAPIError, match='read-only transaction'):
        with ro.begin() as c: c.execute(sa.text('DELETE FROM runs'))
    from torchember import store
    try:
        ex = app(url, wait=0.1)   # routes this process's reads of `url` through a read-only engine
        assert run in [v for _, v in ex.run_picker.options]
        ex.stop()
    finally: store._engines.pop(store.db_url(url), None)   # later tests of this process write there
