"""The package's shape, checked from its source (no imports, no processes):

- no import cycles between its modules, counting imports inside functions too (a lazy import is
  still a dependency: `api` <-> `executor/mp` over `load_tokenizer` was one); a package's own
  `__init__` is not an edge (importing `a.b` always runs `a/__init__`);
- speculative methods are named only where speculation lives (spec_decode/, strategies/ar_spec/)
  and where users choose one (messages.py, cli/): the engine and the executors learn of
  speculation through `spec_decode.build.SpecPlan`'s plain data (STYLE.md);
- files and functions stay small enough to hold in one's head (issue 33, STYLE.md): no file over
  MAX_FILE_LINES and no function over MAX_FUNCTION_LINES outside the backends' kernels
  (`backends/`) and the argument parsers (`cli/args.py`).
"""
import ast
import pathlib
import re

import lmdeploy_lite

ROOT = pathlib.Path(lmdeploy_lite.__file__).parent
PACKAGE = 'lmdeploy_lite'
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60
SIZE_EXEMPT = ('pytorch/backends/', 'cli/args.py')      # kernels; argument parsers


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob('*.py'):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix('').parts]
        out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
    return out


def _imports(module: str, path: pathlib.Path, modules) -> set[str]:
    """The package modules `module` imports anywhere in its source."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition('.')[0]
        return name or None

    package = module if path.name == '__init__.py' else module.rpartition('.')[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                base = '.'.join(package.split('.')[:len(package.split('.')) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith(PACKAGE):
                found |= {known(f'{base}.{a.name}') if f'{base}.{a.name}' in modules
                          else known(base) for a in node.names}
    return found - {None, module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert len(graph) > 50 and graph['lmdeploy_lite.api']       # the walk saw the package
    assert 'lmdeploy_lite.pytorch.engine.executor' in graph['lmdeploy_lite.api']
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_lazy_import_cycle():
    assert _cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]


SPECULATION_HOMES = ('pytorch/spec_decode/', 'pytorch/strategies/ar_spec/', 'messages.py', 'cli/')
METHOD_CHECK = re.compile(r"""method\s*[!=]=|['"](qwen3_5_mtp|ngram)['"]""")


def test_method_names_only_where_speculation_lives():
    offenders = [f'{path.relative_to(ROOT)}:{n}: {line.strip()}'
                 for path in ROOT.rglob('*.py')
                 if not str(path.relative_to(ROOT)).startswith(SPECULATION_HOMES)
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if METHOD_CHECK.search(line)]
    assert offenders == []


def test_files_and_functions_stay_small():
    too_long = []
    for path in sorted(ROOT.rglob('*.py')):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(SIZE_EXEMPT):
            continue
        source = path.read_text()
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            too_long.append(f'{relative}: {lines} lines (at most {MAX_FILE_LINES})')
        too_long += [f'{relative}:{node.lineno} {node.name}: {length} lines (at most '
                     f'{MAX_FUNCTION_LINES})' for node in ast.walk(ast.parse(source))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES]
    assert not too_long, 'split these:\n' + '\n'.join(too_long)
