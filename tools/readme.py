"Write README.md from nbs/index.ipynb and its saved outputs (nbdev-readme needs Quarto, which these machines lack)."
import sys, re
from pathlib import Path
import nbformat

def _out(o):
    if o.output_type == 'stream': return o.text
    data = o.get('data', {})
    if 'text/markdown' in data: return None, data['text/markdown']
    if 'text/plain' in data: return data['text/plain']
    return ''

def render(nb_path='nbs/index.ipynb')->str:
    nb = nbformat.read(nb_path, as_version=4)
    parts = []
    for c in nb.cells:
        src = c.source.strip()
        if c.cell_type == 'markdown':
            parts.append(src); continue
        if re.search(r'^#\|\s*(hide|exporti?)\b', src, re.M): continue
        src = '\n'.join(l for l in src.splitlines() if not l.startswith('#|')).strip()
        if src: parts.append(f"```python\n{src}\n```")
        outs = [_out(o) for o in c.get('outputs', [])]
        for o in outs:
            if isinstance(o, tuple): parts.append(o[1].strip())
            elif o and o.strip(): parts.append(f"```\n{o.rstrip()}\n```")
    text = '\n\n'.join(parts) + '\n'
    return re.sub(r'^# torchember\n\n> (.*)$', r'# torchember\n\n> \1', text, count=1, flags=re.M)

if __name__ == '__main__':
    out = Path('README.md')
    text = render()
    if '--check' in sys.argv:
        if not out.exists() or out.read_text() != text:
            sys.exit("README.md is out of date with nbs/index.ipynb: run `python tools/readme.py`")
        print("README.md is in sync with nbs/index.ipynb")
    else: out.write_text(text); print("wrote README.md")
