"""Light (issue 19): a notebook executed with one explorer stores plotly.js once. The notebook is executed offline with
nbclient, which keeps the widgets' state in the notebook as Jupyter does, and the written file is measured."""
import nbformat, pytest
from nbclient import NotebookClient

MARKER = 'plotly.js could not find topojson file'   # a string of plotly.js's bundle, once in each copy
CELLS = ["""import torch
from torch import nn
from torchember import torchEmber
from torchember.explore import explore
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
with torchEmber(model, run='tiny', db='store.db') as te:
    for step in range(3):
        loss = model(torch.rand(16, 4)).pow(2).mean()
        loss.backward()
        te.log(loss=loss)""",
"explore(db='store.db', run='tiny')"]

def test_one_explorer_stores_plotly_js_once(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS],
                                  metadata={'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}})
    NotebookClient(nb, timeout=300, kernel_name='python3', store_widget_state=True, resources={'metadata': {'path': str(tmp_path)}}).execute()
    text = nbformat.writes(nb)
    state = nb.metadata['widgets']['application/vnd.jupyter.widget-state+json']['state']
    assert any(s['model_name'] == 'AnyModel' for s in state.values())          # the explorer's figure is in the stored state
    print(f"\nnotebook with one explorer: {len(text) / 2**20:.2f} MiB, {text.count(MARKER)} copies of plotly.js")
    assert text.count(MARKER) == 1
    assert len(text) <= 6 * 2**20
