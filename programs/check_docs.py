
TARGETS = __C2_TARGETS__
def _find(tree, qual):
    node = tree
    for part in qual.split('.'):
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None: return None
    return node
class DocsCheck(unittest.TestCase):
    def test_docstrings_written(self):
        tree = _tree(__C2_REL__)
        for q in TARGETS:
            node = _find(tree, q)
            self.assertIsNotNone(node, q + " is gone")
            doc = ast.get_docstring(node) or ''
            self.assertGreaterEqual(len(doc.split()), 4, q + " has no real docstring")
    def test_code_unchanged(self):
        self.assertEqual(strip_docstrings(_tree(__C2_REL__)), __C2_WANT__, "code other than docstrings changed")
