"Run a Python process with a module that declares entries of torchember's registries, for the registry tests."
import os, subprocess, sys

def run_with_plugin(tmp_path, name:str, source:str, var:str, *args, plugin:bool=True):
    "Run `python *args` in `tmp_path` with module `name` (`source`) importable, named in env `var` when `plugin`."
    (tmp_path/f'{name}.py').write_text(source)
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')])}
    env.pop(var, None)
    if plugin: env[var] = name
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
