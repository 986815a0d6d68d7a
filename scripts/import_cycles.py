"""Import cycles between the modules of idem-runtime: each file is a module, and a path to
another module (`crate::…`, `super::…`, `self::…`, grouped imports included; a module's own
parent or children excepted) is an edge. Prints every cycle; exits 1 if there is one.

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
names = set(mods)
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
    return best
edges = {m: set() for m in names}
for m, src in mods.items():
    src = re.sub(r'#\[cfg\(test\)\]\s*mod tests \{.*', '', src, flags=re.S)
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
sys.exit(1 if out else 0)
