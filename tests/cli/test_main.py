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


LMDEPLOY_FLAGS = ['--backend', 'pytorch', '--trust-remote-code', '--cache-block-seq-len', '32',
                  '--quant-policy', '0', '--tp', '2']


@pytest.mark.parametrize('command', COMMANDS, ids=lambda argv: argv[0])
def test_lmdeploys_standard_flags_are_accepted_on_every_command(monkeypatch, command):
    """What an lmdeploy user writes for the PyTorch engine: --backend pytorch, no-op flags
    (--trust-remote-code: no remote code runs here; --quant-policy 0: no KV quantization),
    --cache-block-seq-len (the KV block size) and --tp on chat and generate too."""
    if command[0] == 'serve' and importlib.util.find_spec('fastapi') is None:
        pytest.skip("needs the 'serve' extra")
    extra = ['--tool-call-parser', 'qwen3coder'] if command[0] == 'serve' else []
    config = _engine_config(monkeypatch, command + LMDEPLOY_FLAGS + extra)
    assert (config.block_size, config.tp) == (32, 2)


@pytest.mark.parametrize('flags', [['--backend', 'turbomind'], ['--quant-policy', '8']])
def test_lmdeploy_flags_that_would_change_the_output_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        cli.main(['chat'] + flags)
    assert 'invalid choice' in capsys.readouterr().err


def test_generation_config_takes_lmdeploys_values(tmp_path, capsys):
    """--generation-config: auto (the model's file), none, lmdeploy's 'lmdeploy' (no file, as
    none) or lmdeploy's folder path (its generation_config.json's sampling values)."""
    (tmp_path / 'generation_config.json').write_text('{"temperature": 0.6, "top_k": 20, '
                                                    '"eos_token_id": 2}')
    def defaults(value):
        args = cli.build_parser().parse_args(['serve', 'api_server', '--generation-config',
                                              value])
        return cli.file_sampling_defaults(args.generation_config, model_path=str(tmp_path))
    assert defaults(str(tmp_path)) == defaults('auto') == {'temperature': 0.6, 'top_k': 20}
    assert defaults('lmdeploy') is defaults('none') is None
    with pytest.raises(SystemExit):
        defaults(str(tmp_path / 'missing'))
    assert '--generation-config' in capsys.readouterr().err
