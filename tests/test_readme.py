"""Every ```python example of the README runs as written (on the embedded model, on CPU)."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'README.md')
BLOCKS = re.findall(r'```python\n(.*?)```', open(README).read(), re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize('index', range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f'README.md python block {index}', 'exec'), {})
    assert capsys.readouterr().out.strip(), 'the example printed nothing'
