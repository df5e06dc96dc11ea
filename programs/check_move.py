
class StructureCheck(unittest.TestCase):
    def test_requested_move(self):
        self.assertTrue(os.path.exists(os.path.join(ROOT, __C2_NEWMOD_FILE__)), "the new module does not exist")
        self.assertIn(__C2_FUNC_NAME__, _top(_tree(__C2_NEWMOD_FILE__)), "the function is not defined in the new module")
        self.assertNotIn(__C2_FUNC_NAME__, _top(_tree(__C2_REL__)), "the function is still defined in the old module")
        import __C2_MODULE__, __C2_NEWMOD__
        self.assertIs(__C2_MODULE__.__C2_FUNC__, __C2_NEWMOD__.__C2_FUNC__, "the old module must re-export the function")
