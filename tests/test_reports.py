"Report card (reports/card.ipynb): rendered by papermill from the committed metrics, and a missing metrics file is named."
import json, shutil
from pathlib import Path
import pytest

pm = pytest.importorskip('papermill')
ROOT = Path(__file__).resolve().parents[1]

def _render(tmp_path, drop=()):
    "Copy the card's inputs into `tmp_path`, drop some metrics files, run the card there; return its markdown outputs."
    rep = tmp_path / 'reports'
    for d in ['metrics', 'provenance']: shutil.copytree(ROOT / 'reports' / d, rep / d)
    shutil.copy(ROOT / 'requirements.lock', tmp_path / 'requirements.lock')
    for n in drop: (rep / 'metrics' / f'{n}.json').unlink()
    out = rep / 'card.executed.ipynb'
    pm.execute_notebook(str(ROOT / 'reports/card.ipynb'), str(out), cwd=str(rep), kernel_name='python3',
                        progress_bar=False, log_output=False)
    nb = json.loads(out.read_text())
    md = [''.join(o['data']['text/markdown']) for c in nb['cells'] if c['cell_type'] == 'code'
          for o in c.get('outputs', []) if 'text/markdown' in o.get('data', {})]
    return '\n'.join(md), json.loads((rep / 'card_headline.json').read_text())

def test_card_renders_from_committed_metrics(tmp_path):
    md, head = _render(tmp_path)
    assert '| stage ' in md and 'Stage-time total:' in md          # the stage-time table and its total
    assert '| eval_rl ' in md and '| base ' in md
    # every claim line carries one of the three statuses (or 'missing' when its file is absent)
    claims = [l for l in md.splitlines() if l.startswith('- **')]
    assert len(claims) >= 6
    assert all(l.split('**')[1] in ('reproduced', 'not reproduced', 'inconclusive at this scale') for l in claims)
    assert any('RL beats agent SFT' in l and 'paired SE' in l for l in claims)
    # the RL claim's status follows from the numbers in rl.json
    d = json.loads((ROOT / 'reports/metrics/rl.json').read_text())['difference']
    want = 'reproduced' if d['diff'] > 2 * d['stderr'] else 'inconclusive at this scale' if d['diff'] > 0 else 'not reproduced'
    assert any(l.startswith(f'- **{want}** — RL beats agent SFT on held-out') for l in claims)
    assert head['rl_minus_sft'] == pytest.approx(d['diff'], abs=1e-6) and 'pipeline_minutes' in head
    assert 'not measured' in md                                    # cells no stage measured are shown as such

def test_card_names_a_missing_metrics_file(tmp_path):
    md, head = _render(tmp_path, drop=['rl'])
    assert 'missing: metrics/rl.json' in md
    assert '- **missing** — RL beats agent SFT' in md
    assert 'rl_minus_sft' not in head and 'ppl_short_base' in head  # the other sections still render
