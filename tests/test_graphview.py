"The model graph drawn (issue 28): edges at a fold level, folding (×N vs called N times), views, layout, figure, search."
import warnings
from collections import defaultdict

import pytest, torch
from torch import nn
from corpus import CORPUS, loss_of, train_step
from torchember import torchEmber, load
from torchember.graphview import (GraphView, fold_graph, node_of, merge_points, layered_layout, default_view, blocks,
                                  extent)

ENDS = {'<input>', '<output>', '<const>'}


def record(model, db, *args, steps=2, run='g', **kwargs):
    "Arm `model`, run `steps` training steps on `args`/`kwargs`, and return the run."
    with torchEmber(model, run=run, db=db) as te:
        for _ in range(steps): loss_of(model(*args, **kwargs)).backward()
    return te.run


def folded_reference(edges, tree, collapsed, folded, consts=False):
    "The edges between nodes, worked out the slow way: each leaf edge's ends mapped to their nodes, self-loops dropped."
    rep = node_of(tree, collapsed, folded)
    return {(rep.get(s, s), rep.get(d, d)) for s, d in zip(edges.src, edges.dst)
            if (consts or s != '<const>') and rep.get(s, s) != rep.get(d, d)}


def check_view(view):
    "What every drawn state must hold: its edges are the folded leaf edges; its layout goes down and has no overlaps."
    g, lay = view.graph(), view.layout()
    assert set(g['edges']) == folded_reference(view.edges, view.tree, view.collapsed, view.folded)
    assert len(g['edges']) == len(set(g['edges']))
    # every true edge is a path through junctions in the drawn graph, and nothing more
    succ = defaultdict(set)
    for s, d in g['drawn']: succ[s].add(d)
    def reach(s):
        out, todo = set(), [s]
        while todo:
            for w in succ[todo.pop()]:
                if w.startswith('<+'): todo.append(w)
                else: out.add(w)
        return out
    drawn = {(s, d) for s in list(succ) if not s.startswith('<+') for d in reach(s)}
    assert drawn == set(g['edges'])
    # layout: no two boxes of a layer overlap; every edge goes down, except the back edges, which go up
    by_layer = defaultdict(list)
    for n in g['nodes']['node']:
        l, r = lay['extent'][n]
        by_layer[lay['layer'][n]].append((lay['x'][n] - l, lay['x'][n] + r))
    for boxes in by_layer.values():
        boxes.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(boxes, boxes[1:]))
    for (s, d), pts in lay['paths'].items():
        ys = [y for _, y in pts]
        if (s, d) in lay['back']: assert all(a < b for a, b in zip(ys, ys[1:]))
        else: assert all(a > b for a, b in zip(ys, ys[1:])), (s, d, ys)
    return g


# ---------------------------------------------------------------- hand-written expectations

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), nn.GELU()
    def forward(self, x): return x + self.act(self.fc(x))

class Stack(nn.Module):
    "Three separate blocks (×3), then one module reused twice (called 2 times), a branch and a loop."
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.shared, self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 1)
    def forward(self, x):
        h = self.inp(x)
        for l in self.layers: h = l(h)
        h = self.shared(self.shared(h))
        return self.head(torch.cat([self.a(h), self.b(h)], -1))

def test_blocks_fold_and_reuse_is_called_n_times(db):
    run = record(Stack(), db, torch.randn(2, 4))
    view = GraphView(run)
    assert view.folded == {'layers.0…2'}
    nd = check_view(view)['nodes'].set_index('node')
    assert nd.loc['layers.0…2', 'label'] == 'Block ×3' and nd.loc['layers.0…2', 'kind'] == 'block'
    assert nd.loc['shared', 'calls'] == 2 and 'called 2 times' in nd.loc['shared', 'label']
    assert '×' not in nd.loc['shared', 'label'] and 'called' not in nd.loc['layers.0…2', 'label']
    assert set(view.graph()['edges']) == {('<input>', 'inp'), ('inp', 'layers.0…2'), ('layers.0…2', 'shared'), ('inp', 'shared'),
                                          ('shared', 'a'), ('shared', 'b'), ('a', 'head'), ('b', 'head'), ('head', '<output>')}
    view.toggle('layers.0…2')                  # unfolded: three collapsed blocks, each residual's skip around the next
    assert set(view.graph()['edges']) >= {('inp', 'layers.0'), ('layers.0', 'layers.1'), ('inp', 'layers.1'), ('layers.2', 'shared')}
    view.toggle('layers.1')
    assert {('layers.0', 'layers.1.fc'), ('inp', 'layers.1.fc'), ('layers.1.act', 'layers.2')} <= set(check_view(view)['edges'])

class Heads(nn.Module):
    "Leaf blocks: four parallel heads fold; the q, k, v, o Linears of an attention, one after another, do not."
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(4, 2) for _ in range(4)])
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
    def forward(self, x):
        h = torch.cat([m(x) for m in self.heads], -1)
        att = torch.softmax(self.q(h) @ self.k(h).T, -1) @ self.v(h)
        return self.o(att)

def test_parallel_leaves_fold_chained_ones_do_not(db):
    run = record(Heads(), db, torch.randn(3, 4))
    view = GraphView(run)
    assert set(blocks(run.tree())) == {'heads.0…3', 'q…o'}
    assert view.folded == {'heads.0…3'}
    g = check_view(view)
    assert {('<input>', 'heads.0…3'), ('heads.0…3', 'q'), ('q', 'o'), ('v', 'o')} <= set(g['edges'])

class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    def forward(self, x):
        for _ in range(2): x = self.b(self.a(x))   # a -> b -> a: a cycle between two nodes
        return self.head(x)

def test_cycles_are_drawn_with_a_back_edge(db):
    view = GraphView(record(Loop(), db, torch.randn(2, 4)))
    g = check_view(view)
    assert ('b', 'a') in g['edges']
    assert view.graph()['fed'] == {'<+0>': ['<input>', 'b']}     # a's inputs: the model's, then b's
    assert view.layout()['back'] == {('b', '<+0>')}              # drawn upward, into the junction above a
    assert view.graph()['nodes'].set_index('node').loc['a', 'calls'] == 2

def test_merge_points_chain_a_residual_stream():
    edges = [('e', 'l1'), ('e', 'l2'), ('o1', 'l2'), ('e', 'l3'), ('o1', 'l3'), ('o2', 'l3')]
    drawn, fed = merge_points(edges)
    assert fed == {'<+0>': ['e', 'o1'], '<+1>': ['e', 'o1', 'o2']}
    assert ('<+0>', '<+1>') in drawn and ('o2', '<+1>') in drawn and ('e', '<+1>') not in drawn

def test_layout_few_crossings_on_a_ladder():
    "Two chains side by side, given in an order that crosses: the sweeps untangle them."
    names = ['a0', 'b0', 'a1', 'b1', 'a2', 'b2']
    lay = layered_layout(names, [('a0', 'b1'), ('b0', 'a1'), ('b1', 'b2'), ('a1', 'a2')])
    x = lay['x']
    assert (x['a0'] < x['b0']) == (x['b1'] < x['a1']) == (x['b2'] < x['a2'])


# ---------------------------------------------------------------- the corpus

@pytest.mark.parametrize('name', list(CORPUS))
def test_corpus(name, db):
    "Every state of the view: the drawn edges are the folded leaf edges, laid out downward, in seven traces."
    model, make_batch = CORPUS[name]()
    with torchEmber(model, run=name, db=db) as te:
        for step in range(2): train_step(model, make_batch(step), step)
    view = GraphView(load(name, db))
    check_view(view)
    assert len(view.figure().data) == 7
    view.collapsed, view.folded = set(), set()
    g = check_view(view)
    leaf = {(s, d) for s, d in zip(view.edges.src, view.edges.dst) if s != d and s != '<const>'}
    assert set(g['edges']) == leaf
    assert len(view.figure('output', 'std').data) == 7


# ---------------------------------------------------------------- Hugging Face models from config

def hf_models():
    tf = pytest.importorskip('transformers')
    def ids(n=12, v=100): return torch.randint(0, v, (2, n), generator=torch.Generator().manual_seed(0))
    small = dict(vocab_size=100)
    return {
        'gpt2': lambda: (tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, **small)), (ids(),), {}),
        'bert': lambda: (tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                           intermediate_size=64, max_position_embeddings=32, **small)), (ids(),), {}),
        't5': lambda: (tf.T5ForConditionalGeneration(tf.T5Config(num_layers=3, num_decoder_layers=3, d_model=32, d_kv=8, d_ff=64,
                                                                  num_heads=4, decoder_start_token_id=0, **small)),
                       (), dict(input_ids=ids(), labels=ids(6))),
        'llama': lambda: (tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **small)),
                          (ids(),), {}),
        'vit': lambda: (tf.ViTForImageClassification(tf.ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                                  intermediate_size=64, image_size=16, patch_size=4, num_labels=3)),
                        (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)),), {}),
    }

def autograd_edges(model, args, kwargs):
    "Leaf edges as autograd sees them: from each leaf call's float inputs back through grad_fns to the leaf outputs made."
    leaves = {m: n for n, m in model.named_modules() if not list(m.children())}
    made, feeds, hooks = defaultdict(list), [], []   # grad_fn -> [(call index, leaf)]: a leaf may return its input as is
    def pre(mod, a, kw): feeds.append((leaves[mod], len(feeds), [t.grad_fn for t in _tensors((a, kw)) if t.grad_fn is not None]))
    def post(mod, a, out):
        for t in _tensors(out):
            if t.grad_fn is not None: made[t.grad_fn].append((len(feeds), leaves[mod]))
    for m in leaves:
        hooks += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post)]
    try: loss_of(model(*args, **kwargs))
    finally:
        for h in hooks: h.remove()
    out = set()
    for dst, i, fns in feeds:
        seen, todo = set(), list(fns)
        while todo:
            f = todo.pop()
            if f in seen: continue
            seen.add(f)
            maker = [n for k, n in made.get(f, []) if k <= i]   # the last leaf that gave this tensor out before the call
            if maker:
                if maker[-1] != dst: out.add((maker[-1], dst))
                continue
            todo.extend(n for n, _ in f.next_functions if n is not None)
    return out

def _tensors(obj, depth=0):
    if isinstance(obj, torch.Tensor): yield obj
    elif depth < 6 and isinstance(obj, dict):
        for v in obj.values(): yield from _tensors(v, depth + 1)
    elif depth < 6 and isinstance(obj, (list, tuple)):
        for v in obj: yield from _tensors(v, depth + 1)
    elif depth < 6 and hasattr(obj, 'to_tuple'): yield from _tensors(obj.to_tuple(), depth + 1)

@pytest.mark.parametrize('name', ['gpt2', 'bert', 't5', 'llama', 'vit'])
def test_hf_edges_match_autograd(name, db):
    "Every module-to-module edge autograd sees is captured, and every captured one is seen by autograd."
    warnings.filterwarnings('ignore')
    torch.manual_seed(0)
    model, args, kwargs = hf_models()[name]()
    model.train()
    ref = autograd_edges(model, args, kwargs)
    with torchEmber(model, run=name, db=db) as te: loss_of(model(*args, **kwargs)).backward()
    view = GraphView(load(name, db))
    captured = {(s, d) for s, d in zip(view.edges.src, view.edges.dst) if s not in ENDS and d not in ENDS and s != d}
    assert ref <= captured, sorted(ref - captured)[:10]
    assert captured <= ref | _no_grad_sources(model, args, kwargs, captured), sorted(captured - ref)[:10]
    # and the drawing of it: folded blocks, bounded traces, every state consistent
    assert any(k == 'block' for k in view.graph()['nodes']['kind'])
    check_view(view)
    assert len(view.figure().data) == 7
    view.collapsed, view.folded = set(), set()
    check_view(view)

def _no_grad_sources(model, args, kwargs, edges):
    "Captured edges from leaves whose outputs carry no grad (a rotary table under `no_grad`): autograd cannot see them."
    leaves = {m: n for n, m in model.named_modules() if not list(m.children())}
    grad_free, hooks = set(), []
    def post(mod, a, out):
        ts = list(_tensors(out))
        if ts and all(t.grad_fn is None for t in ts): grad_free.add(leaves[mod])
    hooks = [m.register_forward_hook(post) for m in leaves]
    try: model(*args, **kwargs)
    finally:
        for h in hooks: h.remove()
    return {(s, d) for s, d in edges if s in grad_free}


# ---------------------------------------------------------------- views: collapse, expand, search, clicks

def llama_run(db, layers=4):
    tf = pytest.importorskip('transformers')
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    with torchEmber(m, run='llama', db=db) as te: m(ids, labels=ids).loss.backward()
    return te.run

def count(view): return int((view.graph()['nodes']['kind'] != 'junction').sum())

def test_collapse_expand_counts(db):
    view = GraphView(llama_run(db))
    block = 'model.layers.0…3'
    assert view.folded == {block}
    n = count(view)
    assert view.graph()['nodes'].set_index('node').loc[block, 'label'] == 'LlamaDecoderLayer ×4'
    view.toggle(block)
    assert count(view) == n - 1 + 4                        # four instances, each collapsed
    view.toggle('model.layers.2')
    inside = [m for m in view.info if m.startswith('model.layers.2.') and not view.info[m].get('children')]
    assert count(view) == n - 1 + 3 + len(inside)
    view.toggle('model.layers.2.self_attn')               # collapse one container again
    assert count(view) == n - 1 + 3 + len(inside) - 4 + 1  # its q, k, v, o become one node
    check_view(view)
    view.toggle(block)                                     # folded again
    assert count(view) == n
    with pytest.raises(KeyError): view.toggle('lm_head')

def test_large_model_opens_near_150_nodes(db):
    "A deep model whose blocks do not repeat opens cut to at most 150 nodes, and the folded view shows the rest."
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()) if i % 2 else nn.ReLU(),
                                          nn.Linear(4, 4)) for i in range(100)])
    view = GraphView(record(model, db, torch.randn(2, 4)))
    assert len(view.blocks) == 0 or all(len(b['members']) < 100 for b in view.blocks.values())
    assert 8 <= count(view) <= 152
    check_view(view)

def test_search_reveals_and_clicks_name_modules(db):
    view = GraphView(llama_run(db))
    assert view.search('up_proj', reveal=False) == ['model.layers.0…3']   # hidden in the folded block
    hits = view.search('layers.2.mlp.up')
    assert hits == ['model.layers.2.mlp.up_proj']
    assert view.node_at({'points': [{'customdata': hits[0]}]}) == dict(node=hits[0], kind='module', module=hits[0], block=None)
    assert len(view.search('Linear')) >= 1                 # many matches: nothing opened, the nodes holding them answered
    assert view.search('no such module') == []
    fig = view.figure(highlight=hits)
    nodes = list(fig.data[4].customdata)
    assert fig.data[4].marker.line.width[nodes.index(hits[0])] == 3

def test_figure_traces_bounded_and_instances_clickable(db):
    small, big = GraphView(llama_run(db, 2)), GraphView(llama_run(str(db) + '2', 12))
    for v in (small, big):
        f = v.figure('weight_grad', 'norm')
        assert [t.name for t in f.data] == ['containers', 'container names', 'edges', 'arrows', 'modules', 'instances', 'scale']
        assert set(f.data[4].customdata) == set(v.graph()['nodes']['node'])
    f = big.figure()
    assert list(f.data[5].customdata) == [f'model.layers.{i}' for i in range(12)]
    assert big.node_at(f.data[5].customdata[3]) == dict(node='model.layers.3', kind='instance', module='model.layers.3',
                                                        block='model.layers.0…11')
    big.collapsed, big.folded = set(), set()
    assert len(big.figure().data) == 7
