"Each class's methods are defined in its own chapter; a higher chapter adds one only where its body needs that layer."
import ast, importlib, pkgutil, torchember
from pathlib import Path

# class -> the higher chapters that add methods to it with `@patch`, each for one concern its body needs
ADDED = {
    'Run': {'torchember.diagnose': 'diagnose (runs the detectors) and thin (keeps the steps diagnose names)',
            'torchember.figures': "picture, Run's one plotting method",
            'torchember.report': 'report (writes the report page)'},
    'torchEmber': {'torchember.explore': 'explore (opens the explorer)'},
    'Recorder': {'torchember.compiled': "the compiled path's measurements"},
}

def _modules():
    for m in pkgutil.walk_packages(torchember.__path__, 'torchember.'):
        if m.name != 'torchember._modidx': yield importlib.import_module(m.name)

def _classes():
    for mod in _modules():
        for v in vars(mod).values():
            if isinstance(v, type) and v.__module__ == mod.__name__: yield v

def _defined_in(v):
    f = getattr(v, 'fget', None) or getattr(v, '__func__', None) or v
    return getattr(f, '__module__', None) if callable(f) else None

def test_methods_live_with_their_class():
    found = {}
    for cls in _classes():
        for name, v in vars(cls).items():
            where = _defined_in(v)
            if where is not None and where.startswith('torchember') and where != cls.__module__:
                found[(cls.__name__, name)] = where
    stray = {k: w for k, w in found.items() if w not in ADDED.get(k[0], {})}
    assert not stray, f"methods added to a class outside its chapter, from a chapter ADDED does not list: {stray}"

def _imports(mod)->set:
    "The torchember modules that module `mod` imports, by name."
    path = Path(mod.__file__)
    pkg = mod.__name__ if path.name == '__init__.py' else mod.__name__.rsplit('.', 1)[0]   # what `.` names there
    tree = ast.parse(path.read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = pkg.rsplit('.', n.level - 1)[0] if n.level else ''
            out.add(f"{base}.{n.module}" if n.level and n.module else base if n.level else n.module)
        elif isinstance(n, ast.Import): out |= {a.name for a in n.names}
    return {m for m in out if m and m.startswith('torchember')}

def test_added_from_above():
    "A chapter that adds methods sits above the class's: the class's module never imports it."
    for cls, chapters in ADDED.items():
        for where in chapters:
            owner = getattr(importlib.import_module(where), cls, None)
            if owner is None: continue   # no longer added there
            assert where not in _imports(importlib.import_module(owner.__module__)), (cls, where)
