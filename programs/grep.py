
import fnmatch, json, os, re, sys
a = json.loads(os.environ["C2_GREP"])
rx = re.compile(a["pattern"])
root, ctx, glob, limit = a["path"], a["context"], a["glob"], a["max_matches"]
skip = set(a["skip"])
def files():
    if os.path.isfile(root): yield root; return
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if not any(fnmatch.fnmatch(d, s) for s in skip))
        for n in sorted(fns):
            if any(fnmatch.fnmatch(n, s) for s in skip): continue
            p = os.path.join(dp, n)
            rel = os.path.relpath(p, ".")
            if glob and not (fnmatch.fnmatch(n, glob) or fnmatch.fnmatch(rel, glob)): continue
            if os.path.islink(p): continue
            yield p
n = 0; nfiles = 0; out = []
for p in files():
    try:
        with open(p, "rb") as f: b = f.read(2_000_000)
    except OSError: continue
    if b"\0" in b[:8192]: continue
    lines = b.decode("utf-8", "replace").splitlines()
    hits = [i for i, l in enumerate(lines) if rx.search(l)]
    if not hits: continue
    nfiles += 1; rel = os.path.relpath(p, ".")
    shown = set(); last = None
    for i in hits:
        n += 1
        if n > limit: continue
        lo, hi = max(0, i - ctx), min(len(lines) - 1, i + ctx)
        if ctx and last is not None and lo > last + 1: out.append("--")
        for j in range(lo, hi + 1):
            if j in shown: continue
            shown.add(j); out.append(f"{rel}{':' if j == i or j in hits else '-'}{j + 1}{':' if j == i or j in hits else '-'}{lines[j]}")
        last = hi
if out: print("\n".join(out))
if n > limit: print(f"[... {n - limit} more matches not shown; narrow the pattern, path or glob]")
print(f"[{n} match{'es' if n != 1 else ''} in {nfiles} file{'s' if nfiles != 1 else ''}]")
