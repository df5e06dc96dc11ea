
class StructureCheck(unittest.TestCase):
    def test_requested_rename(self):
        tree = _tree(__C2_REL__)
        self.assertIn(__C2_NEW__, _top(tree), "the helper has not been renamed")
        self.assertNotIn(__C2_OLD__, _top(tree), "the old name is still defined")
        left = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == __C2_OLD__]
        self.assertEqual(left, [], "references to the old name remain")
