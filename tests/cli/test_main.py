"""`lmdeploy_lite` command-line flags reach the engine config they ask for (no engine is built:
`pipeline` is replaced by one that hands back its config)."""
import importlib.util

import pytest

import lmdeploy_lite
from lmdeploy_lite.cli import main as cli

COMMANDS = (['generate', '--prompt', 'x'], ['chat'], ['serve', 'api_server', '--server-port', '0'])


class Built(Exception):
    """Raised in place of building a pipeline; args: (the PytorchEngineConfig,)."""


def _engine_config(monkeypatch, argv: list[str]):
    def pipeline(model_path, backend_config, *args, **kwargs):
        raise Built(backend_config)
    monkeypatch.setattr(lmdeploy_lite, 'pipeline', pipeline)
    with pytest.raises(Built) as e:
        cli.main(argv + ['--device', 'cpu'])
    return e.value.args[0]


@pytest.mark.parametrize('command', COMMANDS, ids=lambda argv: argv[0])
@pytest.mark.parametrize('flags,enabled', [([], True), (['--enable-prefix-caching'], True),
                                           (['--no-enable-prefix-caching'], False)],
                         ids=['default', 'on', 'off'])
def test_prefix_caching_flag_on_every_command_reaches_the_engine_config(monkeypatch, command,
                                                                         flags, enabled):
    if command[0] == 'serve' and importlib.util.find_spec('fastapi') is None:
        pytest.skip("needs the 'serve' extra")
    config = _engine_config(monkeypatch, command + flags)
    assert config.enable_prefix_caching is enabled
