"""Config loading: every shipped YAML loads; bad keys, types and values name themselves."""
from __future__ import annotations

from pathlib import Path

import pytest

from megaray.config import RunConfig
from megaray.errors import ConfigError
from megaray.loader import build_config, load_config, shipped_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    assert {p.stem for p in CONFIGS} >= {"demo", "debug"}
    assert shipped_config("demo").is_file()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.num_params() > 0


@pytest.mark.parametrize("data, key, words", [
    ({"train": {"stpes": 3}}, "train.stpes", "unknown key"),
    ({"trian": {}}, "trian", "unknown section"),
    ({"train": {"steps": "ten"}}, "train.steps", "expected int"),
    ({"train": {"steps": 2.5}}, "train.steps", "expected int"),
    ({"optim": {"lr": "fast"}}, "optim.lr", "expected float"),
    ({"optim": {"num_shards": 9}}, "optim.num_shards", "at most 4"),
    ({"optim": {"num_shards": 0}}, "optim.num_shards", ">= 1"),
    ({"optim": {"schedule": "exp"}}, "optim.schedule", "cosine"),
    ({"optim": {"clip_grad_norm": -1.0}}, "optim.clip_grad_norm", "> 0"),
    ({"train": {"compute_dtype": "fp8"}}, "train.compute_dtype", "float32"),
    ({"model": {"shape": "debug", "num_key_value_heads": 3}}, "model.num_key_value_heads", "divide"),
    ({"model": {"shape": "gpt5"}}, "model.shape", "unknown shape"),
    ({"model": {"shape": "debug", "rope_scaling": {"rope_type": "yarn"}}}, "model.rope_scaling", "not supported"),
    ({"train": {"seq_len": 4096}}, "train.seq_len", "max_position_embeddings"),
    ({"worker": {"device": "tpu"}}, "worker.device", "cpu"),
    ({"debug": {"crash_actor": "optimizer"}}, "debug.crash_step", "together"),
    ({"train": []}, "train", "mapping"),
])
def test_bad_config_names_the_key(data, key, words):
    with pytest.raises(ConfigError) as e:
        build_config(data)
    assert e.value.key == key
    assert key in str(e.value) and words in str(e.value)


def test_overrides_and_shape_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  shape: debug\n  tie_word_embeddings: false\ntrain:\n  steps: 3\n")
    cfg = load_config(p, ["train.steps=7", "optim.lr=0.01", "optim.clip_grad_norm=null"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 0.01 and cfg.optim.clip_grad_norm is None
    assert cfg.model.hidden_size == 32 and cfg.model.tie_word_embeddings is False
    with pytest.raises(ConfigError, match="train.nope"):
        load_config(p, ["train.nope=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(p, ["train.steps"])


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "missing.yaml")


def test_bad_config_fails_before_ray_starts(capsys):
    import ray

    from megaray.pipelines.train import main

    assert not ray.is_initialized()
    assert main([str(shipped_config("debug")), "optim.num_shards=99"]) == 2
    assert not ray.is_initialized()
    assert "optim.num_shards" in capsys.readouterr().err


def test_renamed_keys_are_still_read_with_a_warning(tmp_path, caplog):
    """megaray 0.3 renamed optim.placement (optim.resident_units) and worker.placement
    (worker.node): the old names still load to the same config, each with a warning; both
    names at once is an error naming the old one."""
    (tmp_path / "old.yaml").write_text("model: {shape: debug}\noptim: {placement: 2}\nworker: {placement: local}\n")
    with caplog.at_level("WARNING", logger="megaray"):
        old = load_config(tmp_path / "old.yaml", ["optim.placement=3"])
    new = build_config({"model": {"shape": "debug"}, "optim": {"resident_units": 3}, "worker": {"node": "local"}})
    assert old.optim.resident_units == 3 and old.optim.resident_count == 3 and old.worker.node == "local"
    assert old.optim == new.optim and old.worker == new.worker
    said = caplog.text
    assert "optim.placement is called optim.resident_units" in said and "worker.placement is called worker.node" in said
    with pytest.raises(ConfigError, match=r"optim\.placement.*old name of optim\.resident_units"):
        load_config("debug", ["optim.placement=2", "optim.resident_units=2"])
