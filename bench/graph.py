"""How quick the model graph (issue 28) is to open: `GraphView` on Llamas built from config, recorded for two steps.

    python bench/graph.py [--layers 24 160] [--repeat 3]

For each `--layers` figure it records a tiny-width `LlamaForCausalLM` (hidden 32) for two training steps into a
temporary store, then times, in wall seconds, what opening the graph costs in the explorer: `GraphView(run)` (reading
the run's graph, tree and events, the default view) plus `figure()` (stats, layout, the plotly figure) serialised to
JSON as a browser gets it; then the same with everything expanded and unfolded. The first open of a process pays
plotly's and SQLAlchemy's warm-up; the median of `--repeat` opens after it is what a running explorer pays. It prints
the machine first. A benchmark, not a test.
"""
import argparse, statistics, sys, tempfile, time, warnings
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import machine_line

def record(layers:int, db:str):
    "A run of a `layers`-layer Llama from config, two training steps, in store `db`."
    import transformers
    from torchember import torchEmber
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    with torchEmber(m, run=f'llama{layers}', db=db) as te:
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 8))
            m(ids, labels=ids).loss.backward()
    return te.run, sum(1 for _ in m.modules())

def open_view(run, expanded:bool=False)->tuple:
    "Seconds to open `run`'s graph and draw it (to JSON), and the view."
    from torchember.graphview import GraphView
    t = time.perf_counter()
    v = GraphView(run)
    if expanded: v.collapsed, v.folded = set(), set()
    v.figure('weight_grad', 'norm').to_json()
    return time.perf_counter() - t, v

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--layers', type=int, nargs='+', default=[24, 160])
    p.add_argument('--repeat', type=int, default=3)
    a = p.parse_args(argv)
    warnings.filterwarnings('ignore')
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    db = str(Path(tempfile.mkdtemp())/'graph.db')
    print('| model | modules | view | nodes | first open (s) | open, warm: median (s) |\n|---|---|---|---|---|---|')
    for n in a.layers:
        run, mods = record(n, db)
        for expanded in (False, True):
            if expanded and mods > 1000: continue        # a 2,000-module model opens folded; expanded is not a target
            first, v = open_view(run, expanded)
            warm = statistics.median(open_view(run, expanded)[0] for _ in range(a.repeat))
            shown = int((v.graph()['nodes']['kind'] != 'junction').sum())
            print(f"| Llama, {n} layers | {mods} | {'expanded' if expanded else 'opened (collapsed, folded)'} | {shown} | "
                  f"{first:.2f} | {warm:.2f} |")

if __name__ == '__main__': main()
