import ast, hashlib, os, sys, unittest
ROOT = os.getcwd()
def _tree(rel):
    with open(os.path.join(ROOT, rel)) as f: return ast.parse(f.read())
def _top(tree): return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
