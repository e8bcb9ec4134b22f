"""Issue 50: the report of a run that blew up tells the story first: the cause on top, linked to its evidence; the NaN table
folded with "show all"; the graph coloured where the cause began (not at a dead last step); a module's output that spans
decades on a log axis; short class names under the bars. In a real browser (Debian's Chromium, driven by Playwright, as
tests/test_browser.py), the page opens on the story: test-artifacts/report-story.png."""
import re
from pathlib import Path
import pytest
from causes import scaled_weight
import torchember.report as rep
from torchember.report import report_html, page_figures

FOLDED_ROWS = getattr(rep, 'FOLDED_ROWS', 12)   # the page's, where it folds

ARTIFACTS = Path(__file__).resolve().parent.parent/'test-artifacts'

@pytest.fixture(scope='module')
def blown(tmp_path_factory):
    "The GPT whose `blocks.1.mlp.proj` weight was scaled 1e4 at step 60, its page."
    r = scaled_weight(str(tmp_path_factory.mktemp('story')/'store.db'))
    return r, report_html(r)

def test_the_story_comes_first(blown):
    r, page = blown
    story = page.split('<h2>What happened</h2>')[1].split('<h2')[0]
    assert page.index('<h2>What happened</h2>') < page.index('<h2>Findings</h2>') < page.index('<h2>NaN and Inf</h2>')
    assert 'blocks.1.mlp.proj' in story and 'step 60' in story and 'the first NaN' in story
    assert '<a href="#finding-1">evidence</a>' in story and '<h2 id="finding-1">Finding 1: ✖ error · step 60' in page

def test_the_nan_table_is_folded(blown):
    r, page = blown
    part = page.split('<h2>NaN and Inf</h2>')[1].split('<h2')[0]
    shown, rest = part.split('<details>')
    assert shown.count('<tr>') <= FOLDED_ROWS + 1                     # its first rows, one per module and ttype, and a header
    assert re.search(r'<summary>show all (\d+) tensors</summary>', rest) and rest.count('<tr>') > FOLDED_ROWS

def test_the_graph_is_coloured_where_it_began(blown):
    r, page = blown
    head = next(h for h in re.findall(r'<h2[^>]*>([^<]*)</h2>', page) if h.startswith('The model'))
    assert 'at step 60' in head and 'blocks.1.mlp.proj' in head

def test_a_module_spanning_decades_is_drawn_on_a_log_axis(blown):
    r, page = blown
    axes = [layout.get('yaxis', {}).get('type') for traces, layout in page_figures(page)   # a module's figure: output on the left
            if any(a.get('text', '').startswith('output std (log') for a in layout.get('annotations', []))]
    assert axes and set(axes) == {'log'}

def test_long_class_names_are_short_under_the_bars(blown):
    r, page = blown
    assert 'NonDynamicallyQuantizableLinear' in ''.join(r.modules()['mtype'])
    for traces, layout in page_figures(page):
        for t in traces:
            if t.get('type') == 'bar': assert not any('NonDynamicallyQuantizable' in str(x) for x in t.get('x', []))

def test_the_page_opens_on_the_story_in_a_browser(blown, tmp_path):
    "Screenshot of the top of the page in a real browser: test-artifacts/report-story.png."
    from test_browser import CHROMIUM, ARGS, sync_playwright
    if sync_playwright is None or not Path(CHROMIUM).exists(): pytest.skip('needs playwright and chromium: run .ci/browser-deps')
    r, page = blown
    f = tmp_path/'report.html'
    f.write_text(page, encoding='utf-8')
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            pg = b.new_page(viewport={'width': 1280, 'height': 1000})
            pg.goto(f.as_uri())
            pg.wait_for_selector('.js-plotly-plot .main-svg', timeout=120_000)
            pg.screenshot(path=str(ARTIFACTS/'report-story.png'))
            top = pg.evaluate("() => [...document.querySelectorAll('h2')].slice(0, 2).map(h => [h.textContent, h.getBoundingClientRect().top])")
            assert top[0][0] == 'What happened' and top[0][1] < 400          # the story in the first screen
            story = pg.inner_text('ul.story')
            assert 'blocks.1.mlp.proj' in story and 'the first NaN' in story
            assert pg.is_visible('details summary') and not pg.is_visible('details table')   # the whole NaN table folded
            pg.screenshot(path=str(ARTIFACTS/'report-story-full.png'), full_page=True)
        finally: b.close()
