"""Import cycles between the modules of idem-runtime: each file is a module, and a path to
another module (`crate::…`, `super::…`, `self::…`, grouped imports included; a module's own
parent or children excepted) is an edge. Prints every cycle; exits 1 if there is one.

Also the layers' direction: the engine (`engine`, `engine::…`) uses the stores (`store`,
`store::…`), never the reverse, and the stores use no other layer that uses the engine
(`http`, `default_store`); the engine uses neither the HTTP layer (`http`) nor the macro's
expansion (`expansion`), which are built on it. A module mounted from another file
(`#[path = "file.rs"] mod name;` in the crate root) is known by its name. A path through the crate root's re-exports counts as an arrow
to the module that defines the item; links in comments and docs do not. Prints every arrow
against it; exits 1 if there is one.

    python3 scripts/import_cycles.py
"""
import os, re, sys
root = 'idem-runtime/src'
mods = {}
for dp, dn, fn in os.walk(root):
    for f in fn:
        if f.endswith('.rs'):
            p = os.path.join(dp, f)
            rel = os.path.relpath(p, root)[:-3].replace(os.sep, '::')
            rel = rel.replace('lib', 'crate') if rel == 'lib' else rel
            mods[rel] = open(p).read()
# `#[path = "file.rs"] mod name;` in the crate root: the file's module is `name`.
for file, name in re.findall(r'#\[path\s*=\s*"([\w/]+)\.rs"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)', mods['crate']):
    file = file.replace('/', '::')
    if file in mods:
        mods[name] = mods.pop(file)
names = set(mods)
# What the crate root re-exports (`pub use crate::engine::{Operation, …}`), so that a path
# through the root (`crate::Operation`) is an edge to the module that defines it.
reexports = {}
for path, group in re.findall(r'pub use crate::([\w:]+)::\{([^}]*)\};', mods['crate']):
    for item in group.split(','):
        item = item.strip().split(' as ')[-1]
        if item and item != 'self': reexports[item] = path
for path, item in re.findall(r'pub use crate::([\w:]+)::(\w+);', mods['crate']):
    reexports[item] = path
def resolve(mod, path):
    parts = path.split('::')
    if parts[0] == 'crate':
        base = []
        parts = parts[1:]
    elif parts[0] == 'super':
        base = mod.split('::')[:-1]
        parts = parts[1:]
        while parts and parts[0] == 'super':
            base = base[:-1]; parts = parts[1:]
    elif parts[0] == 'self':
        base = mod.split('::'); parts = parts[1:]
    else:
        return None
    best = None
    for i in range(len(parts), 0, -1):
        cand = '::'.join(base + parts[:i])
        if cand in names:
            best = cand; break
    if best is None and not base and parts and parts[0] in reexports:
        target = reexports[parts[0]]
        best = target if target in names else target.rsplit('::', 1)[0]
    return best
edges = {m: set() for m in names}
for m, src in mods.items():
    src = re.sub(r'#\[cfg\(test\)\]\s*mod tests \{.*', '', src, flags=re.S)
    # Comments and docs link to items (`[`step`](crate::step)`) without importing them.
    src = re.sub(r'//.*', '', src)
    paths = re.findall(r'\b((?:crate|super|self)(?:::\w+)+)', src)
    # grouped imports: `use crate::{a, b::c, d::{e}}` -> crate::a, crate::b::c, crate::d
    for prefix, group in re.findall(r'\buse\s+((?:crate|super|self)(?:::\w+)*)::\{([^;]*)\};', src):
        depth = 0; item = ''
        for ch in group + ',':
            if ch == '{': depth += 1
            elif ch == '}': depth -= 1
            if ch == ',' and depth == 0:
                name = re.match(r'\s*(\w+(?:::\w+)*)', item)
                if name: paths.append(prefix + '::' + name.group(1))
                item = ''
            else:
                item += ch
    for path in paths:
        t = resolve(m, path)
        if t and t != m and not m.startswith(t + '::') and not t.startswith(m + '::'):
            edges[m].add(t)
# Tarjan
index = {}; low = {}; stack = []; on = set(); out = []; i = [0]
sys.setrecursionlimit(10000)
def sc(v):
    index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in index:
            sc(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: out.append(sorted(comp))
for v in sorted(names):
    if v not in index: sc(v)
for c in out: print('cycle:', ' <-> '.join(c))
print(len(out), 'cycles among', len(names), 'modules')
def under(m, top): return m == top or m.startswith(top + '::')
above = ('engine', 'http', 'default_store')
upward = sorted((m, t) for m in names if under(m, 'store')
                for t in edges[m] if any(under(t, top) for top in above))
upward += sorted((m, t) for m in names if under(m, 'engine')
                 for t in edges[m] if under(t, 'http') or under(t, 'expansion'))
for m, t in upward: print('upward:', m, '->', t)
print(len(upward), 'imports from a layer into the layers above it')
sys.exit(1 if out or upward else 0)
