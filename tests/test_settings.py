"""Settings: file < profile < env < CLI; bad keys and values fail naming key, value, allowed."""

from __future__ import annotations

import pytest
import yaml

from chatpipe.settings import (
    SECTIONS,
    STAGES,
    DataSettings,
    EvalSettings,
    LaunchSettings,
    ParamsError,
    PretrainSettings,
    RLSettings,
    SFTSettings,
    load_section,
    math_settings,
    parse_cli,
    resolve_params,
    validate_all,
    write_profile,
)


def test_defaults_come_from_params_yaml(params_file):
    cfg = load_section(PretrainSettings)
    raw = yaml.safe_load(params_file.read_text())
    assert cfg.depth == raw["pretrain"]["depth"]
    assert cfg.sequence_len == raw["pretrain"]["sequence_len"]


def test_priority_cli_over_env_over_profile_over_file(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_PROFILE", "speedrun")
    assert load_section(PretrainSettings).depth == 24  # profile overlay beats the file
    monkeypatch.setenv("CHATPIPE_PRETRAIN__DEPTH", "12")
    assert load_section(PretrainSettings).depth == 12  # env beats the profile
    assert load_section(PretrainSettings, ["--depth=6"]).depth == 6  # CLI beats env
    assert load_section(PretrainSettings, ["depth=5"]).depth == 5


def test_every_shipped_profile_validates(params_file, monkeypatch):
    profiles = yaml.safe_load(params_file.with_name("profiles.yaml").read_text())
    for name in ["tiny", *profiles]:
        monkeypatch.setenv("CHATPIPE_PROFILE", name)
        assert set(validate_all()) == set(SECTIONS)


def test_out_of_range_value_names_key_value_and_rule(params_file):
    params_file.write_text(params_file.read_text().replace("  depth: 4\n", "  depth: -3\n"))
    with pytest.raises(ParamsError) as e:
        validate_all()
    msg = str(e.value)
    assert "pretrain.depth" in msg and "-3" in msg and "greater than or equal to 1" in msg


def test_unknown_key_lists_allowed_keys(params_file):
    params_file.write_text(params_file.read_text().replace("  depth: 4\n", "  depth: 4\n  deptj: 4\n"))
    with pytest.raises(ParamsError, match=r"pretrain\.deptj.*unknown key; allowed keys: .*depth"):
        validate_all()


def test_wrong_type_and_bad_choice(params_file):
    with pytest.raises(ParamsError, match=r"pretrain\.max_steps = 'lots'"):
        load_section(PretrainSettings, ["--max_steps=lots"])
    with pytest.raises(ParamsError, match=r"launch\.scheduler = 'lsf'.*'local_cwd', 'slurm' or 'kubernetes'"):
        load_section(LaunchSettings, ["--scheduler=lsf"])


def test_unknown_env_key_and_section_and_profile(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_PRETRAIN__DEPHT", "3")
    with pytest.raises(ParamsError, match="CHATPIPE_PRETRAIN__DEPHT"):
        load_section(PretrainSettings)
    monkeypatch.delenv("CHATPIPE_PRETRAIN__DEPHT")
    params_file.write_text(params_file.read_text() + "\npretrian: {}\n")
    with pytest.raises(ParamsError, match="pretrian"):
        validate_all()
    with pytest.raises(ParamsError, match="profile = 'huge' is not defined; allowed: tiny, speedrun"):
        resolve_params(params_file, "huge")


def test_broken_yaml_names_file_and_line(params_file):
    params_file.write_text("data:\n  source: [synthetic\n")
    with pytest.raises(ParamsError, match=rf"{params_file.name}:\d+: not valid YAML"):
        validate_all()


def test_write_profile_is_checked_and_atomic(params_file):
    write_profile("speedrun")
    assert resolve_params()["profile"] == "speedrun"
    with pytest.raises(ParamsError):
        write_profile("nope")
    assert yaml.safe_load(params_file.read_text())["profile"] == "speedrun"


def test_parse_cli_forms():
    assert parse_cli(["--a=1", "--b-c", "2", "d=3"]) == {"a": "1", "b_c": "2", "d": "3"}
    with pytest.raises(ParamsError, match="no value"):
        parse_cli(["--dangling"])


def test_a_removed_key_names_what_replaced_it(params_file):
    params_file.write_text(params_file.read_text().replace("  seed: 42\n", "  seed: 42\n  chat_examples: 2000\n", 1))
    with pytest.raises(
        ParamsError, match=r"data\.chat_examples = 2000: this key was removed: .*mixture item's `limit`"
    ):
        load_section(DataSettings)


def test_rl_declares_only_what_it_reads(params_file):
    """The training schedule knobs RL never read are refused, saying what RL does instead."""
    assert not {"total_batch_size", "warmup_steps", "schedule", "compile"} & set(RLSettings.model_fields)
    with pytest.raises(
        ParamsError,
        match=r"rl\.warmup_steps = '5' \(from command line --warmup_steps\): this key was removed: RL's policy LR",
    ):
        load_section(RLSettings, ["--warmup_steps=5"])


def test_resume_neutral_fields_are_marked_on_the_fields(params_file):
    """Observation-only settings leave the run fingerprint alone; anything that changes the weights is in it."""
    base = load_section(SFTSettings)
    changed = load_section(SFTSettings, ["--eval_prompts=3", "--log_every=7", "--checkpoint_every=3"])
    assert math_settings(changed) == math_settings(base)
    assert math_settings(load_section(SFTSettings, ["--matrix_lr=0.01"])) != math_settings(base)
    neutral = set(snapshot_keys(base)) - set(math_settings(base))
    assert neutral == {
        "device",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "log_every",
        "compile",
        "eval_tokens",
        "eval_prompts",
        "eval_arith",
        "eval_max_tokens",
        "eval_temperature",
        "eval_baseline",
    }


def snapshot_keys(settings) -> list[str]:
    return list(settings.model_dump())


def test_stage_names_are_dvc_yaml_order():
    from pathlib import Path

    stages = list(yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"])
    assert tuple(s for s in stages if s != "profile") == STAGES  # `profile` is DVC bookkeeping, not a stage


# --------------------------------------------------------------------------- issue 15 item 5


def test_env_var_with_an_unknown_section_is_rejected(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_PRETRAINN__DEPTH", "5")
    with pytest.raises(ParamsError, match=r"CHATPIPE_PRETRAINN__DEPTH.*unknown section 'pretrainn'.*pretrain"):
        validate_all()


def test_errors_in_env_and_cli_values_name_their_source(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_PRETRAIN__DEPTH", "0")
    with pytest.raises(ParamsError, match="environment variable CHATPIPE_PRETRAIN__DEPTH") as e:
        load_section(PretrainSettings)
    assert str(params_file) not in str(e.value)
    monkeypatch.delenv("CHATPIPE_PRETRAIN__DEPTH")
    with pytest.raises(ParamsError, match="command line --nnodes") as e:
        load_section(LaunchSettings, {"nnodes": 0})
    assert str(params_file) not in str(e.value)


def test_malformed_json_in_an_env_var_is_a_clear_error(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_EVAL__MODEL_DIRS", "[base")
    with pytest.raises(ParamsError, match=r"CHATPIPE_EVAL__MODEL_DIRS = '\[base'.*JSON"):
        load_section(EvalSettings)


def test_launch_rejects_zero_nodes_from_the_command_line(params_file, capsys):
    from chatpipe.launch import main

    assert main(["pretrain", "--nnodes=0", "--dryrun"]) == 2
    assert "nnodes" in capsys.readouterr().err


@pytest.mark.parametrize(("old", "new"), [("bpb_tokens", "eval_tokens"), ("stages", "model_dirs")])
def test_a_renamed_eval_key_names_its_new_name_and_the_allowed_keys(params_file, old, new):
    """eval.bpb_tokens is eval_tokens (as in the training sections) and eval.stages is model_dirs now."""
    assert old not in EvalSettings.model_fields and new in EvalSettings.model_fields
    text = params_file.read_text().replace("\neval:\n", f"\neval:\n  {old}: [base]\n", 1)
    params_file.write_text(text)
    with pytest.raises(ParamsError, match=rf"eval\.{old} = \['base'\]: this key was removed: renamed to {new}") as e:
        validate_all()
    assert "allowed keys: model_dirs, " in str(e.value) and "eval_tokens" in str(e.value)


def test_pretrain_inherits_the_training_embedding_lr_and_params_yaml_sets_it(params_file):
    """Pretrain declares no embedding_lr of its own: the default is TrainSettings', the value params.yaml's."""
    from chatpipe.settings import TrainSettings

    pretrain, train = PretrainSettings.model_fields["embedding_lr"], TrainSettings.model_fields["embedding_lr"]
    assert (pretrain.default, pretrain.metadata) == (train.default, train.metadata) == (0.2, train.metadata)
    assert "embedding_lr" not in PretrainSettings.__annotations__
    raw = yaml.safe_load(params_file.read_text())
    assert load_section(PretrainSettings).embedding_lr == raw["pretrain"]["embedding_lr"] == 0.3


def test_python_m_chatpipe_settings_writes_the_overlays(params_file, tmp_path, monkeypatch):
    """dvc.yaml's profile stage: validate everything, then write the named sections' overlay files."""
    from chatpipe.settings.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "eval"]) == 0
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["eval.yaml", "pretrain.yaml"]
    assert main(["pretrian"]) == 2
