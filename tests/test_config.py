import dataclasses
import json

import pytest

from spes_node.config import (
    ModelConfig,
    SpesConfig,
    SwarmConfig,
    config_digest,
    list_presets,
    load_config,
    load_preset,
)

REFERENCE = {
    "spes-1b": {
        "hidden_size": 768,
        "num_layers": 12,
        "num_heads": 12,
        "num_experts": 16,
        "top_k": 2,
        "expert_ffn": 2048,
        "num_shards": 4,
        "seq_len": 2048,
    },
    "spes-7b": {
        "hidden_size": 2048,
        "num_layers": 16,
        "num_heads": 16,
        "num_experts": 32,
        "top_k": 4,
        "expert_ffn": 2048,
        "num_shards": 4,
    },
}


def _write(tmp_path, text: str, name: str = "cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_preset_loads_and_validates():
    presets = list_presets()
    assert {"tiny", "small", "spes-1b", "spes-7b"} <= set(presets)
    for name in presets:
        cfg = load_preset(name)
        assert cfg.name == name
        assert cfg.validate() is cfg
        assert cfg.model.num_experts % cfg.swarm.num_shards == 0


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_presets_have_published_shapes(name):
    cfg = load_preset(name)
    shapes = {
        **{k: getattr(cfg.model, k) for k in dataclasses.asdict(cfg.model)},
        "num_shards": cfg.swarm.num_shards,
        "seq_len": cfg.train.seq_len,
    }
    assert {k: shapes[k] for k in REFERENCE[name]} == REFERENCE[name]
    assert cfg.model.kv_heads == cfg.model.num_heads
    assert (cfg.train.beta1, cfg.train.beta2, cfg.train.weight_decay) == (0.9, 0.95, 0.1)
    assert (cfg.train.min_lr_ratio, cfg.train.grad_clip) == (0.1, 1.0)
    assert (cfg.model.z_loss, cfg.model.lb_loss) == (1e-3, 0.01)
    assert cfg.swarm.sync_steps == 100 and cfg.swarm.merge_interval == 500 and cfg.swarm.merge_topk == 4


def test_tiny_is_small_enough_for_a_cpu():
    cfg = load_preset("tiny")
    assert cfg.model.vocab_size == 260 and cfg.data.tokenizer == "bytes" and cfg.data.source == "default"
    assert cfg.model.num_experts == 8 and cfg.model.top_k == 2 and cfg.swarm.num_shards == 4


def test_small_keeps_the_proportions_of_spes_1b():
    small, ref = load_preset("small").model, load_preset("spes-1b").model
    assert (small.num_experts, small.top_k) == (ref.num_experts, ref.top_k)
    assert abs(small.expert_ffn / small.hidden_size - ref.expert_ffn / ref.hidden_size) < 0.1


def test_unknown_preset_names_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'no-such-preset' \(available: .*tiny"):
        load_preset("no-such-preset")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[swarm]\nnum_shards = 3\n", "swarm.num_shards"),
        ("[swarm]\nnum_shards = 0\n", "swarm.num_shards"),
        ("[swarm]\nnum_shards = 'four'\n", "swarm.num_shards"),
        ("[swarm]\nnum_shards = 2.0\n", "swarm.num_shards"),
        ("[swarm]\nnum_shard = 2\n", "swarm.num_shard"),
        ("[swarm]\nfrozen_dtype = 'fp8'\n", "swarm.frozen_dtype"),
        ("[swarm]\nouter_optimizer = 'adam'\n", "swarm.outer_optimizer"),
        ("[model]\nnum_heads = 5\n", "model.num_heads"),
        ("[model]\nnum_kv_heads = 3\n", "model.num_kv_heads"),
        ("[model]\ntop_k = 9\n", "model.top_k"),
        ("[model]\nnorm_topk_prob = 1\n", "model.norm_topk_prob"),
        ("[model]\nhidden_size = true\n", "model.hidden_size"),
        ("[train]\nlr = '3e-4'\n", "train.lr"),
        ("[train]\nlr = -1.0\n", "train.lr"),
        ("[train]\nmin_lr_ratio = 1.5\n", "train.min_lr_ratio"),
        ("[train]\nbeta2 = 1.0\n", "train.beta2"),
        ("[train]\nseq_len = 4096\n", "train.seq_len"),
        ("[data]\nval_fraction = 0\n", "data.val_fraction"),
        ("[nodel]\nhidden_size = 64\n", "nodel"),
        ("swarm = 4\n", "swarm"),
        ("name = 3\n", "name"),
    ],
)
def test_bad_config_names_the_field(tmp_path, text, field):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert f"'{field}'" in message or f"{field}:" in message, message
    assert str(path) in message
    assert "\n" not in message


def test_malformed_toml_names_the_file(tmp_path):
    path = _write(tmp_path, "[model\nhidden_size = 64\n")
    with pytest.raises(ValueError, match="cfg.toml") as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read config .*nope.toml"):
        load_config(tmp_path / "nope.toml")


def test_partial_file_takes_defaults_for_the_rest(tmp_path):
    cfg = load_config(_write(tmp_path, "[swarm]\nnum_shards = 2\n[train]\nlr = 1\n"))
    assert cfg.swarm.num_shards == 2 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.model == ModelConfig() and cfg.swarm.sync_steps == SwarmConfig().sync_steps


def test_json_config_file(tmp_path):
    cfg = load_preset("tiny")
    assert load_config(_write(tmp_path, cfg.to_json(), "cfg.json")) == cfg


def test_json_round_trip_for_every_preset():
    for name in list_presets():
        cfg = load_preset(name)
        back = SpesConfig.from_json(cfg.to_json())
        assert back == cfg
        assert back.to_json() == cfg.to_json()


def test_from_json_rejects_bad_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        SpesConfig.from_json("{")


def test_hash_is_stable_and_canonical():
    cfg = load_preset("tiny")
    assert cfg.hash() == load_preset("tiny").hash() == config_digest(cfg.to_json())
    assert len(cfg.hash()) == 64
    reordered = json.dumps(json.loads(cfg.to_json()), indent=2, sort_keys=False)
    assert SpesConfig.from_json(reordered).hash() == cfg.hash()


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 + 1
    if isinstance(value, float):
        return value * 0.5 + 0.125
    return value + "x"


def test_hash_changes_when_any_field_changes():
    cfg = load_preset("tiny")
    base = cfg.hash()
    data = cfg.to_dict()
    seen = {base}
    for section, values in data.items():
        for name, value in values.items() if isinstance(values, dict) else [(None, values)]:
            changed = json.loads(json.dumps(data))
            if name is None:
                changed[section] = _changed(value)
            else:
                changed[section][name] = _changed(value)
            digest = config_digest(json.dumps(changed, sort_keys=True, separators=(",", ":")))
            assert digest not in seen, (section, name)
            seen.add(digest)
    fields = sum(len(v) if isinstance(v, dict) else 1 for v in data.values())
    assert len(seen) == fields + 1


def test_hash_changes_through_replace_and_replace_validates():
    cfg = load_preset("tiny")
    other = cfg.replace(swarm={"sync_steps": 5})
    assert other.swarm.sync_steps == 5 and cfg.swarm.sync_steps != 5
    assert other.hash() != cfg.hash()
    assert cfg.replace(swarm={"sync_steps": cfg.swarm.sync_steps}).hash() == cfg.hash()
    with pytest.raises(ValueError, match="swarm.num_shards"):
        cfg.replace(swarm={"num_shards": 3})
    with pytest.raises(ValueError, match="section 'swarmm'"):
        cfg.replace(swarmm={"num_shards": 2})


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import spes_node.config as module

    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("Config")):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                following = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), (
                    f"{node.name}.{stmt.target.id} has no docstring"
                )


def _float_fields() -> list[str]:
    cfg = SpesConfig()
    return [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, section.name))
        for f in dataclasses.fields(getattr(cfg, section.name))
        if isinstance(getattr(getattr(cfg, section.name), f.name), float)
    ]


def test_the_float_fields_are_found():
    assert {"swarm.heartbeat_s", "train.lr", "model.rope_theta", "data.val_fraction"} <= set(_float_fields())


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("field", _float_fields())
def test_every_float_field_must_be_finite(tmp_path, field, value):
    section, name = field.split(".")
    path = _write(tmp_path, f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert f"{field}:" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_a_swarm_record_with_an_infinite_heartbeat_is_refused(value):
    data = json.loads(load_preset("tiny").to_json())
    text = json.dumps(data).replace('"heartbeat_s": 2.0', f'"heartbeat_s": {value}')
    assert value in text
    with pytest.raises(ValueError, match="swarm.heartbeat_s"):
        SpesConfig.from_json(text)


@pytest.mark.parametrize(
    ("section", "name", "value"),
    [
        ("swarm", "heartbeat_s", 0.0),
        ("swarm", "heartbeat_s", -1.0),
        ("swarm", "heartbeat_s", 1e12),
        ("model", "rope_theta", 0.0),
        ("model", "rms_norm_eps", 0.0),
        ("model", "init_std", -0.02),
        ("model", "z_loss", -1e-3),
        ("model", "lb_loss", -0.01),
        ("train", "weight_decay", -0.1),
    ],
)
def test_float_fields_out_of_range(section, name, value):
    with pytest.raises(ValueError, match=f"{section}.{name}"):
        load_preset("tiny").replace(**{section: {name: value}})
