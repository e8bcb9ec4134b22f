"""The explorer in a real browser: JupyterLab runs a notebook that trains a tiny model and opens the explorer; headless
Chromium (the system's, driven by Playwright) must render its plotly figures with data, live mode must bring new steps
to the page from its thread, a click on a bar must reach Python and redraw the history, and so must a click on a cell
of the model map (whose hover names the cell's step, iteration and kind), the history then showing that module, ttype
and stat with the cell's step (and iteration) marked; and a click on a
finding of the list at the top (the notebook's model has a known culprit: its last layer's weights are multiplied by 4
before step 15) must open its evidence on top and that module's history below, the step marked. Screenshots go to
test-artifacts/explorer.png (after the bar click), test-artifacts/explorer-map-click.png,
test-artifacts/explorer-finding.png and, once the **graph** switch draws the model and a click on a node has shown that
module's history, test-artifacts/explorer-graph.png.

Needs `chromium` (Debian package, /usr/bin/chromium) and the `playwright` Python package; `.ci/browser-deps`
installs both. Skipped, saying why, only when one of them is missing."""
import os, re, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import pytest

CHROMIUM = os.environ.get('TORCHEMBER_CHROMIUM', '/usr/bin/chromium')
ARGS = ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
        '--disable-background-networking', '--disable-component-update', '--disable-sync']
ARTIFACTS = Path(__file__).resolve().parent.parent/'test-artifacts'
WAIT_MS = 120_000

try: from playwright.sync_api import sync_playwright
except ImportError: sync_playwright = None

pytestmark = [
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: run .ci/browser-deps (pip install playwright)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no chromium at {CHROMIUM}: run .ci/browser-deps (apt-get install chromium)"),
]

NOTEBOOK = [
"""import torch
from torch import nn
from torchember import torchEmber
from torchember import hist_stats
from torchember.explore import explore

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with torchEmber(model, run='tiny', db='store.db') as te:
    te.how_record_out(hist_stats(16))
    for step in range(20):
        if step == 15:
            with torch.no_grad(): model[2].weight *= 4   # the culprit the findings must name
        x = torch.rand(32, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        te.log(loss=loss)""",
"""ex = explore(db='store.db', run='tiny', interval=0.2)
ex.module_picker.value = '0'
ex""",
"""with torchEmber(model, run='tiny', db='store.db', resume=True) as te:
    te.how_record_out(hist_stats(16))
    for step in range(10):
        x = torch.rand(32, 8)
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()""",
]

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def wait_http(url:str, timeout:float, proc):
    "Wait until `url` answers; fail if the server died or the time ran out (the fixture prints its log)."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None: pytest.fail(f"jupyter lab exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200: return
        except OSError: pass
        time.sleep(0.25)
    pytest.fail(f"jupyter lab did not answer at {url} within {timeout:.0f} s")

@pytest.fixture
def lab(tmp_path):
    "A JupyterLab server on a free port, rooted in `tmp_path`, with a notebook that opens the explorer; killed afterwards."
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK],
                                  metadata={'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}})
    nbformat.write(nb, tmp_path/'explorer.ipynb')
    port, home = free_port(), tmp_path/'home'
    env = {**os.environ, 'JUPYTER_RUNTIME_DIR': str(home/'runtime'), 'PYTHONUNBUFFERED': '1'}
    env.pop('TORCHEMBER_DB', None)
    log = open(tmp_path/'jupyter.log', 'w')
    proc = subprocess.Popen(
        [sys.executable, '-m', 'jupyterlab', '--no-browser', f'--port={port}', '--ServerApp.port_retries=0',
         "--ServerApp.token=", "--ServerApp.password=", '--ServerApp.ip=127.0.0.1', f'--ServerApp.root_dir={tmp_path}',
         '--expose-app-in-browser', f'--LabApp.workspaces_dir={home/"workspaces"}', f'--LabApp.user_settings_dir={home/"settings"}',
         '--LabApp.news_url=', '--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate', '--LabApp.extension_manager=readonly',
         *(['--allow-root'] if hasattr(os, 'geteuid') and os.geteuid() == 0 else [])],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f'http://127.0.0.1:{port}/api/status', 60, proc)
        yield f'http://127.0.0.1:{port}'
    finally:
        try: os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError: pass
        try: proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()
        print((tmp_path/'jupyter.log').read_text()[-3000:])

def run_cells(page, upto:int=None, cell:int=None):
    "Run the notebook's cells above `upto`, or its cell `cell`, through JupyterLab's own commands."
    page.evaluate("""async ([upto, cell]) => {
      const app = window.jupyterapp, w = app.shell.currentWidget;
      await w.context.ready; await w.sessionContext.ready;
      w.content.activeCellIndex = upto ?? cell;
      await app.commands.execute(upto !== null ? 'notebook:run-all-above' : 'notebook:run-cell');
    }""", [upto, cell])

MAP_CELL = """([j, i]) => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')].find(g => (g.layout.annotations || []).some(a => (a.text || '').includes('every module')));
  gd.scrollIntoView({block: 'center'});
  const L = gd._fullLayout, tr = gd._fullData[0], r = gd.getBoundingClientRect();
  return [r.left + L.xaxis._offset + L.xaxis.l2p(tr.x[j]), r.top + L.yaxis._offset + L.yaxis.l2p(i), tr.y[i]];
}"""
STAT_PICKED = "[...document.querySelectorAll('.widget-select-multiple select option')].filter(o => o.selected).map(o => o.textContent)"
# the explorer's figure: its width, and how far its right edge is past its output area's (over 0: cut off)
FITS = ("(() => { const g = document.querySelector('.js-plotly-plot'), o = g.closest('.jp-OutputArea-output');"
        " return [g._fullLayout.width, Math.round(g.getBoundingClientRect().right - o.getBoundingClientRect().right)]; })()")
STATUS = "[...document.querySelectorAll('.widget-label')].map(l => l.textContent).join('|')"
# a title the explorer broke into lines (its figure as wide as the page leaves it) read as one, its lines joined by spaces
TITLES = ("[...document.querySelectorAll('.js-plotly-plot .gtitle, .js-plotly-plot .annotation-text')]"
          ".map(t => { const ls = [...t.querySelectorAll('tspan.line')]; return ls.length ? ls.map(l => l.textContent).join(' ') : t.textContent; })")
HOVER = "[...document.querySelectorAll('.js-plotly-plot .hoverlayer .hovertext')].map(t => t.textContent)"
GRAPH_NODE = """(name) => {
  const gd = document.querySelector('.js-plotly-plot');
  const tr = gd._fullData.find(t => t.name === 'modules' && (t.customdata || []).includes(name));
  if (!tr) return null;
  const i = tr.customdata.indexOf(name), L = gd._fullLayout;
  const xa = L['xaxis' + tr.xaxis.slice(1)], ya = L['yaxis' + tr.yaxis.slice(1)];
  const at = () => { const r = gd.getBoundingClientRect(); return [r.left + xa._offset + xa.l2p(tr.x[i]), r.top + ya._offset + ya.l2p(tr.y[i])]; };
  let el = gd.parentElement;   // the notebook scrolls in a panel of its own: bring the node to mid-height
  while (el && !(el.scrollHeight > el.clientHeight && /(auto|scroll)/.test(getComputedStyle(el).overflowY))) el = el.parentElement;
  if (el) el.scrollTop += at()[1] - window.innerHeight / 2;
  return at();
}"""

def test_explorer_renders_in_jupyterlab(lab):
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page, errors = browser.new_page(viewport={'width': 1500, 'height': 1700}), []
        page.on('pageerror', lambda e: errors.append(str(e)))
        try:
            page.goto(f'{lab}/lab/tree/explorer.ipynb', timeout=WAIT_MS)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=WAIT_MS)
            page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
            run_cells(page, upto=2)                                     # train, open the explorer

            # one figure (one copy of plotly.js) with every plot drawn: the map and the histogram, the history's lines, the bars
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length == 1", timeout=WAIT_MS)
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .barlayer .point path').length > 0"
                                   " && document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line').length > 0"
                                   " && document.querySelectorAll('.js-plotly-plot .heatmaplayer image').length > 0", timeout=WAIT_MS)
            lines = page.locator('.js-plotly-plot .scatterlayer path.js-line')
            assert lines.count() >= 3                                   # the envelope's and band's edges, the mean
            assert any(len(d or '') > 50 for d in lines.evaluate_all("ls => ls.map(l => l.getAttribute('d'))"))
            assert page.locator('.js-plotly-plot .scatterlayer .trace').count() >= 5
            bars = page.locator('.js-plotly-plot .barlayer .point path')
            assert bars.count() == 2                                    # two Linear layers with weight grads
            assert any('0 · output over steps' in t for t in page.evaluate(f"() => {TITLES}"))
            # the figure as wide as the page leaves it: inside the notebook's column, following the window as it is resized
            page.wait_for_function(f"() => {FITS}[1] <= 0 && {FITS}[0] != 980", timeout=20_000)
            wide = page.evaluate(f"() => {FITS}")[0]
            page.set_viewport_size({'width': 1200, 'height': 1700})
            page.wait_for_function(f"() => {FITS}[0] < {wide} && {FITS}[1] <= 0", timeout=20_000)
            page.set_viewport_size({'width': 1500, 'height': 1700})
            page.wait_for_function(f"() => {FITS}[0] == {wide}", timeout=20_000)
            assert '· 20 steps' in page.evaluate(f"() => {STATUS}")

            # live mode: the thread's updates reach the page, and the page's stop button reaches the thread
            page.get_by_role('button', name='live').click()
            page.wait_for_function(f"() => {STATUS}.includes(' · live')", timeout=30_000)
            run_cells(page, cell=2)                                     # ten more steps
            page.wait_for_function(f"() => {STATUS}.includes('· 30 steps · live')", timeout=60_000)
            page.get_by_role('button', name='stop').click()
            page.wait_for_function(f"() => /last updated \\d\\d:\\d\\d:\\d\\d · 30 steps($|\\|)/.test({STATUS})", timeout=30_000)

            # a click on the second bar (module 2) goes through Python and redraws the history, of the bars' ttype
            for attempt in range(3):
                bars.nth(1).click(force=True)
                try:
                    page.wait_for_function(f"() => {TITLES}.some(t => /2 · weight_grad weight over (applied )?steps/.test(t))", timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            no_news = page.get_by_role('button', name='No', exact=True)   # JupyterLab's news toast, if it asks
            if no_news.count(): no_news.first.click()
            page.wait_for_timeout(500)
            page.screenshot(path=str(ARTIFACTS/'explorer.png'))

            # a click on a cell of the model map (module 2's weight grads at step 12): its history of that ttype and stat
            page.select_option('.widget-dropdown:has(label:text-is("stat")) select', label='std')
            page.wait_for_timeout(1500)
            for attempt in range(3):                                     # (a map drawn again under the mouse drops its hover)
                x, y, _ = page.evaluate(MAP_CELL, [12, 1])               # its hover names the step's iteration and kind
                page.mouse.move(0, 0); page.mouse.move(x, y, steps=3)
                try:
                    page.wait_for_function(f"() => {HOVER}.some(t => t.includes('step 12 · iteration 12 · train'))", timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            for attempt in range(3):
                x, y, label = page.evaluate(MAP_CELL, [12, 1])
                page.mouse.click(x, y)
                try:
                    page.wait_for_function(f"() => {TITLES}.some(t => /2 · weight_grad weight over (applied )?steps · step 12 marked \\(it\\. 12\\)/.test(t))",
                                           timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            assert label.strip().startswith('2 ·')
            assert page.evaluate(STAT_PICKED) == ['std']
            page.wait_for_timeout(500)
            page.evaluate("() => window.scrollTo(0, 0)")
            page.screenshot(path=str(ARTIFACTS/'explorer-map-click.png'), full_page=True)

            # a drag over steps 5 to 25 of the map zooms: Python reads that range again (its title says which steps);
            # a double-click shows the whole run again
            for attempt in range(3):
                (x0, y, _), (x1, _, _) = page.evaluate(MAP_CELL, [5, 1]), page.evaluate(MAP_CELL, [25, 1])
                page.mouse.move(x0, y); page.mouse.down(); page.mouse.move((x0 + x1) / 2, y + 1, steps=5)
                page.mouse.move(x1, y + 2, steps=5); page.mouse.up()
                try:
                    page.wait_for_function(f"() => {TITLES}.some(t => /every module × step.*· steps \\d+–\\d+ \\(double-click for all\\)/.test(t))",
                                           timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            zoomed = next(t for t in page.evaluate(f"() => {TITLES}") if 'double-click for all' in t)
            a, b = map(int, re.search(r'steps (\d+)–(\d+)', zoomed).groups())
            assert 3 <= a <= 7 and 23 <= b <= 27, zoomed
            page.wait_for_timeout(1500)                                 # the figure laid out again
            page.screenshot(path=str(ARTIFACTS/'explorer-map-zoom.png'), full_page=True)
            x, y, _ = page.evaluate(MAP_CELL, [10, 1])                  # a cell of the zoomed map
            page.mouse.dblclick(x, y)
            page.wait_for_function(f"() => !{TITLES}.some(t => t.includes('double-click for all'))", timeout=20_000)

            # a click on a finding in the list: its evidence on top, its module's history below with its step marked
            # (diagnose names the cause first: the weight of `2` that its output's spike followed)
            option = page.locator('.widget-select select option', has_text='· cause · 2 (Linear) weight')
            assert option.count() == 1, page.evaluate("() => [...document.querySelectorAll('.widget-select select option')].map(o => o.textContent)")
            for attempt in range(3):
                option.click()
                try:
                    page.wait_for_function(f"() => {TITLES}.some(t => t.includes('cause at step 15 (it. 15): 2 (Linear)'))"
                                           f" && {TITLES}.some(t => /^2 · .* over steps · step 15 marked \\(it\\. 15\\)/.test(t))", timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            assert 'left' in page.locator('.widget-html', has_text="module '2' (Linear)").first.text_content()
            page.wait_for_timeout(500)
            page.evaluate("() => window.scrollTo(0, 0)")
            page.screenshot(path=str(ARTIFACTS/'explorer-finding.png'), full_page=True)
            # the graph switch draws the model's data flow below the map; a click on a node shows that module's history
            page.get_by_role('button', name='graph').click()
            page.wait_for_function(f"() => {TITLES}.some(t => t.includes('nodes (click one for its history)'))", timeout=30_000)
            page.wait_for_timeout(1500)
            for attempt in range(3):
                xy = page.evaluate(GRAPH_NODE, '0')
                assert xy is not None, page.evaluate(f"() => {TITLES}")
                page.mouse.click(*xy)
                try:
                    page.wait_for_function(f"() => {TITLES}.some(t => /^0 · weight_grad weight over (applied )?steps/.test(t))", timeout=20_000)
                    break
                except Exception:
                    if attempt == 2: raise
            page.wait_for_timeout(500)
            page.screenshot(path=str(ARTIFACTS/'explorer-graph.png'), full_page=True)
            assert not [e for e in errors if 'plotly' in e.lower() or 'widget' in e.lower()], errors
        except Exception:
            page.screenshot(path=str(ARTIFACTS/'explorer-failed.png'))
            print('status:', page.evaluate(f"() => {STATUS}"), '\ntitles:', page.evaluate(f"() => {TITLES}"), '\npage errors:', errors)
            raise
        finally:
            browser.close()
