
import importlib
class StructureCheck(unittest.TestCase):
    def test_requested_move(self):
        names, orig_rel = __C2_NAMES__, __C2_REL__
        orig = importlib.import_module(__C2_ORIG__)
        new = importlib.import_module(__C2_NEW__)
        new_rel = os.path.relpath(os.path.realpath(new.__file__), os.path.realpath(ROOT))
        self.assertFalse(new_rel.startswith('..'), "the new module is not part of the project")
        for n in names:
            self.assertIn(n, _top(_tree(new_rel)), n + " is not defined in the new module")
            self.assertNotIn(n, _top(_tree(orig_rel)), n + " is still defined in the old module")
            self.assertIs(getattr(orig, n), getattr(new, n), "the old module must re-export " + n)
