"""Make the README's picture of the model map: train the demo's small CNN with a learning rate that makes it blow up,
write its report, and screenshot the report's first figure (the map) in headless Chromium.

    python tools/heatmap_png.py [--out tools/heatmap.png]

Needs what tests/test_browser.py needs (`bash .ci/browser-deps`: the system's Chromium and Playwright's Python
package); plotly's own static export (kaleido) is not used, as it needs a Chrome of its own."""
import argparse, os, tempfile
from pathlib import Path
import torch
from torch import nn
import torchember
from torchember.demo import bars, small_cnn

def record(db:str, steps:int=120, blow_up_at:int=90)->str:
    "The demo's CNN trained `steps` steps, its learning rate raised to 1e4 at step `blow_up_at`; the run's name."
    torch.manual_seed(0)
    model, (x, y) = small_cnn(), bars(steps * 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with torchember.torchEmber(model, run='cnn', db=db, overwrite=True) as te:
        for i in range(steps):
            if i == blow_up_at: opt.param_groups[0]['lr'] = 1e4
            loss = nn.functional.cross_entropy(model(x[i*16:(i+1)*16]), y[i*16:(i+1)*16])
            loss.backward(); opt.step(); opt.zero_grad()
            te.log(loss=loss, lr=opt.param_groups[0]['lr'])
    return 'cnn'

def screenshot(page_path:Path, out:Path, chromium:str):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=['--headless=new', '--no-sandbox', '--disable-gpu'])
        page = b.new_page(viewport={'width': 1250, 'height': 900}, device_scale_factor=1)
        page.goto(page_path.as_uri())
        page.wait_for_selector('.js-plotly-plot .heatmaplayer image')
        page.evaluate("() => Plotly.relayout(document.querySelector('.js-plotly-plot'), {title: {text: "
                      "'every module × step, log10 of its weight-grad norm: the learning rate jumps at step 90'}, 'margin.t': 40})")
        page.wait_for_timeout(300)
        page.locator('.js-plotly-plot').first.screenshot(path=str(out))
        b.close()

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default=str(Path(__file__).with_name('heatmap.png')))
    ap.add_argument('--chromium', default=os.environ.get('TORCHEMBER_CHROMIUM', '/usr/bin/chromium'))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run = record(str(Path(d)/'store.db'))
        page = torchember.report(run, Path(d)/'report.html', str(Path(d)/'store.db'))
        screenshot(page, Path(a.out), a.chromium)
    print(a.out)
