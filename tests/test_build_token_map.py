"""tools/build_token_map.py on the embedded model's tokenizer and a corpus the test writes: text
files, token-id files (.json, .ids), both output formats, ties, eos ids kept, and an engine run
with the map it wrote."""
import json
import subprocess
import sys
from collections import Counter

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.spec_decode.token_map import load_token_map
from tests.helpers import accepting
from tests.helpers.token_maps import ROOT, build_token_map_tool

VOCAB = 4096
CORPUS = ['def add(a, b):\n    return a + b\n\n\n' * 20,
          'import os\nimport sys\n\nfor name in os.listdir("."):\n    print(name)\n' * 10]
tool = build_token_map_tool()


@pytest.fixture(scope='module')
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def write_corpus(directory) -> list[str]:
    paths = []
    for i, text in enumerate(CORPUS):
        path = directory / f'doc{i}.txt'
        path.write_text(text)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize('ext', ['json', 'safetensors'])
def test_text_corpus_gives_the_top_n_most_frequent_first(ext, tmp_path, tokenizer, capsys):
    top = 16                                         # the corpus has 27 distinct tokens
    out = str(tmp_path / f'map.{ext}')
    tool.main(['--model', EMBEDDED_MODEL_DIR, '--top', str(top), '--out', out,
               *write_corpus(tmp_path)])
    token_map = load_token_map(out, VOCAB).tolist()
    assert len(token_map) == len(set(token_map)) == top
    counts = Counter(t for text in CORPUS for t in tokenizer.encode(text, add_special_tokens=False))
    assert len(counts) > top and token_map[0] == counts.most_common(1)[0][0]
    ranked = sorted(counts, key=lambda t: (-counts[t], t))      # by count, ties by the lower id
    assert token_map == ranked[:top - 2] + [0, 2]    # the eos ids (config.json) kept at the end
    assert f'{top} of {VOCAB} ids' in capsys.readouterr().out


def test_token_id_files_ties_clipping_and_always_include(tmp_path):
    (tmp_path / 'a.json').write_text(json.dumps([[7, 7, 7, 3], [5, 5, 3]]))
    (tmp_path / 'b.ids').write_text('9 9\n3 100\n')
    files = [str(tmp_path / 'a.json'), str(tmp_path / 'b.ids')]
    out = str(tmp_path / 'm.json')
    # counts: 3 x3, 7 x3, 5 x2, 9 x2, 100 x1; ties by the lower id
    tool.main(['--model', EMBEDDED_MODEL_DIR, '--top', '4', '--out', out, '--always-include',
               'none', *files])
    assert json.loads(open(out).read()) == [3, 7, 5, 9]
    tool.main(['--model', EMBEDDED_MODEL_DIR, '--top', '4', '--out', out, *files])
    assert json.loads(open(out).read()) == [3, 7, 0, 2]          # eos ids 0 and 2 kept
    tool.main(['--model', EMBEDDED_MODEL_DIR, '--top', '4', '--out', out, '--always-include',
               '100,eos', *files])
    assert json.loads(open(out).read()) == [3, 100, 0, 2]
    with pytest.raises(SystemExit):
        tool.main(['--model', EMBEDDED_MODEL_DIR, '--out', out, '--always-include', '4096',
                   *files])
    tool.main(['--model', EMBEDDED_MODEL_DIR, '--top', '100000', '--out', out, *files])
    token_map = json.loads(open(out).read())
    assert len(token_map) == VOCAB and token_map[:6] == [3, 7, 5, 9, 100, 0]   # clipped
    (tmp_path / 'bad.ids').write_text('1 4096')
    with pytest.raises(ValueError, match=r'bad.ids: token id 4096 is outside the vocabulary '
                                         r'0..4095'):
        tool.main(['--model', EMBEDDED_MODEL_DIR, '--out', out, str(tmp_path / 'bad.ids')])
    (tmp_path / 'bad.json').write_text(json.dumps([1, 'x']))
    with pytest.raises(ValueError, match=r"bad.json: 'x' is not a token id"):
        tool.main(['--model', EMBEDDED_MODEL_DIR, '--out', out, str(tmp_path / 'bad.json')])


def test_command_line_and_an_engine_run_with_the_map(tmp_path, tokenizer):
    """The script as users run it; its map drives the MTP draft of an engine whose greedy
    output equals plain greedy output. The script reads the corpus as token ids (the text's, so
    the map is the text corpus's: asserted), which spares its process importing transformers'
    tokenizers (~4 s on two cores); text files: the tests above, through the same main()."""
    out, ids = str(tmp_path / 'map.safetensors'), tmp_path / 'corpus.json'
    ids.write_text(json.dumps([tokenizer.encode(text, add_special_tokens=False)
                               for text in CORPUS]))
    done = subprocess.run([sys.executable, 'tools/build_token_map.py', '--model',
                           EMBEDDED_MODEL_DIR, '--top', '1024', '--out', out, str(ids)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(load_token_map(out, VOCAB)) == 1024
    from_text = str(tmp_path / 'text_map.safetensors')
    tool.main(['--model', EMBEDDED_MODEL_DIR, '--top', '1024', '--out', from_text,
               *write_corpus(tmp_path)])
    assert load_token_map(out, VOCAB).tolist() == load_token_map(from_text, VOCAB).tolist()
    k, prompts = 2, [list(p) for p in accepting.prompts()[:2]]
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    cfg = PytorchEngineConfig(**accepting.BASE)
    engine = build_engine(accepting.model_dir(), cfg, SpeculativeConfig(num_speculative_tokens=k,
                                                                  draft_token_map=out),
                    progress=False)
    got = [s.generated_ids for s in engine.generate(prompts, gen)]
    assert engine.spec_stats.num_accepted_tokens > 0
    assert engine.agent.draft_probs.shape[-1] == 1024
    assert got == accepting.reference(0, prompts, gen).token_ids
