"""Settings: file < profile < env < CLI; bad keys and values fail naming key, value, allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from chatpipe.settings import (
    SECTIONS,
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


def test_the_stage_list_is_read_from_dvc_yaml(tmp_path):
    """dvc.yaml is the one list of stages: reorder or add one there and every reader sees it."""
    from chatpipe.settings import dvc_stages, pipeline_stages

    repo = list(yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"])
    assert list(dvc_stages()) == repo
    assert "reward_model" in pipeline_stages() and "profile" not in pipeline_stages()  # profile: bookkeeping
    other = tmp_path / "dvc.yaml"
    other.write_text(
        yaml.safe_dump({"stages": {"profile": {}, "tokenizer": {}, "data": {}, "extra": {}}}, sort_keys=False)
    )
    assert pipeline_stages(other) == ("tokenizer", "data", "extra")


def test_a_missing_or_empty_dvc_yaml_is_named(tmp_path):
    from chatpipe.settings import pipeline_stages

    with pytest.raises(ParamsError, match=r"dvc.yaml: missing; the list of stages is read from it"):
        pipeline_stages(tmp_path / "dvc.yaml")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "dvc.yaml").write_text("vars: []\n")
    with pytest.raises(ParamsError, match=r"no `stages:` mapping"):
        pipeline_stages(tmp_path / "empty" / "dvc.yaml")


def test_no_module_keeps_its_own_list_of_stages():
    """A tuple of several stage names written out in code is a second list that can drift from dvc.yaml."""
    import re

    root = Path(__file__).resolve().parents[1]
    listed = re.compile(r"\"midtrain\",\s*\"sft\",\s*\"reward_model\"")
    offenders = [
        str(p.relative_to(root))
        for top in ("chatpipe", "stages", "flows")
        for p in (root / top).rglob("*.py")
        if listed.search(p.read_text())
    ]
    assert offenders == []


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


# ---------------------------------------------------------------- settings that reject what they cannot mean


def set_key(params_file, section: str, key: str, value: str) -> None:
    """Edit ``section.key`` of params.yaml in place, as a person would (the key stays given once)."""
    lines = params_file.read_text().splitlines()
    start = lines.index(f"{section}:")
    at = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(f"  {key}:"))
    lines[at] = f"  {key}: {value}"
    params_file.write_text("\n".join(lines) + "\n")


def test_duplicate_section_names_both_lines_and_the_file(params_file):
    text = params_file.read_text()
    line = text.splitlines().index("pretrain:") + 1
    params_file.write_text(text + "pretrain:\n  depth: 6\n")
    last = len(text.splitlines()) + 1
    with pytest.raises(ParamsError) as e:
        validate_all()
    msg = str(e.value)
    assert f"{params_file}:{last}" in msg and "'pretrain' given twice" in msg and f"first at line {line}" in msg


def test_duplicate_key_in_profiles_yaml_names_that_file(params_file):
    profiles = params_file.with_name("profiles.yaml")
    profiles.write_text(profiles.read_text().replace("    depth: 24\n", "    depth: 24\n    depth: 26\n", 1))
    with pytest.raises(ParamsError, match=rf"{profiles}:\d+: key 'depth' given twice \(first at line \d+\)"):
        validate_all()


def test_a_binary_params_yaml_is_a_named_error_not_a_traceback(params_file):
    params_file.write_bytes(b"pretrain:\n  depth: 4\n\xff\xfe\x00\x81 binary")
    with pytest.raises(ParamsError, match=rf"{params_file}:3: not UTF-8 text"):
        validate_all()


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_nan_and_inf_floats_are_refused(params_file, value):
    set_key(params_file, "pretrain", "matrix_lr", value)
    with pytest.raises(ParamsError, match=r"pretrain\.matrix_lr = (nan|inf|-inf): Input should be a finite number"):
        load_section(PretrainSettings)


def test_nan_from_the_environment_names_the_variable(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_PRETRAIN__MATRIX_LR", "nan")
    with pytest.raises(ParamsError, match=r"CHATPIPE_PRETRAIN__MATRIX_LR.*finite number"):
        load_section(PretrainSettings)


@pytest.mark.parametrize(
    ("yaml_value", "why"),
    [("no", "expected an integer, got the boolean false"), ("50.0", "expected an integer, got the float 50.0")],
)
def test_integers_are_strict(params_file, yaml_value, why):
    set_key(params_file, "pretrain", "checkpoint_every", yaml_value)
    with pytest.raises(ParamsError, match=rf"pretrain\.checkpoint_every = .*: {why}"):
        load_section(PretrainSettings)


def test_booleans_are_strict_from_file_env_and_command_line(params_file, monkeypatch):
    set_key(params_file, "pretrain", "lambdas", "1")
    with pytest.raises(ParamsError, match=r"pretrain\.lambdas = 1: expected true or false"):
        load_section(PretrainSettings)
    assert load_section(PretrainSettings, ["--lambdas=true"]).lambdas is True  # the command line says it in words
    with pytest.raises(ParamsError, match=r"lambdas = 'yes' \(from command line --lambdas\): expected true or false"):
        load_section(PretrainSettings, ["--lambdas=yes"])
    monkeypatch.setenv("CHATPIPE_PRETRAIN__DEPTH", "6.5")
    with pytest.raises(ParamsError, match=r"CHATPIPE_PRETRAIN__DEPTH.*expected an integer"):
        load_section(PretrainSettings, ["--lambdas=false"])


@pytest.mark.parametrize(("name", "text", "why"), [("LAMBDAS", "yes", "true or false"), ("DEPTH", "8.0", "an integer")])
def test_environment_text_is_read_as_strictly_as_the_command_line(params_file, monkeypatch, name, text, why):
    # before: under strict mode pydantic-settings coerced env text laxly itself ("yes" was true, "8.0" was 8)
    monkeypatch.setenv(f"CHATPIPE_PRETRAIN__{name}", text)
    with pytest.raises(ParamsError, match=rf"CHATPIPE_PRETRAIN__{name}\): expected {why}, got the text '{text}'"):
        load_section(PretrainSettings)
    monkeypatch.setenv("CHATPIPE_PRETRAIN__DEPTH", " 7 ")
    monkeypatch.setenv("CHATPIPE_PRETRAIN__LAMBDAS", "True")
    cfg = load_section(PretrainSettings)
    assert cfg.depth == 7 and cfg.lambdas is True


@pytest.mark.parametrize("cls", [DataSettings, EvalSettings, PretrainSettings, RLSettings])
def test_seeds_stay_within_a_signed_64_bit_integer(params_file, cls):
    assert load_section(cls, {"seed": 2**63 - 1}).seed == 2**63 - 1
    with pytest.raises(ParamsError, match=rf"{cls.section}\.seed = {2**63} .*less than or equal to {2**63 - 1}"):
        load_section(cls, {"seed": str(2**63)})


def test_nested_environment_keys_are_refused_by_name(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_PRETRAIN__DEPTH__X", "3")
    with pytest.raises(ParamsError, match=r"CHATPIPE_PRETRAIN__DEPTH__X: nested keys below pretrain\.depth"):
        load_section(PretrainSettings)
    monkeypatch.delenv("CHATPIPE_PRETRAIN__DEPTH__X")
    monkeypatch.setenv("CHATPIPE_EVAL__CHATCORE_TASKS__MMLU", '{"task": "mmlu"}')
    with pytest.raises(ParamsError, match=r"CHATPIPE_EVAL__CHATCORE_TASKS__MMLU: nested keys .* as JSON"):
        validate_all()


def test_an_error_in_the_active_profile_is_blamed_on_profiles_yaml(params_file, monkeypatch):
    profiles = params_file.with_name("profiles.yaml")
    profiles.write_text(profiles.read_text().replace("    depth: 24\n", "    depth: -1\n", 1))
    monkeypatch.setenv("CHATPIPE_PROFILE", "speedrun")
    with pytest.raises(ParamsError) as e:
        load_section(PretrainSettings)
    assert str(e.value).startswith(f"{profiles} (profile speedrun): invalid settings")
    assert str(params_file) + ":" not in str(e.value)


def test_every_profile_is_validated_not_only_the_active_one(params_file):
    profiles = params_file.with_name("profiles.yaml")
    profiles.write_text(profiles.read_text().replace("    depth: 24\n", "    depth: -1\n", 1))
    assert resolve_params()["profile"] == "tiny"  # the broken profile is not the active one
    with pytest.raises(ParamsError) as e:
        validate_all()
    msg = str(e.value)
    assert msg.startswith(f"{profiles} (profile speedrun): invalid settings")
    assert "pretrain.depth = -1: Input should be greater than or equal to 1" in msg


def test_a_settings_error_leaves_params_yaml_and_the_overlays_as_they_were(params_file, tmp_path, monkeypatch):
    from chatpipe.settings.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    overlays = {p.name: p.read_bytes() for p in (tmp_path / "profile").iterdir()}
    before = params_file.read_bytes()
    profiles = params_file.with_name("profiles.yaml")
    profiles.write_text(profiles.read_text().replace("    depth: 24\n", "    depth: 24\n    matrix_lr: .nan\n", 1))
    with pytest.raises(ParamsError, match=r"profile speedrun\): invalid settings\n  pretrain\.matrix_lr = nan"):
        write_profile("speedrun")  # the switch is refused before params.yaml is touched
    with pytest.raises(ParamsError, match="finite number"):
        write_profile("d20")  # so is a switch to a good profile while another one is broken
    assert main(["pretrain"]) == 2  # dvc.yaml's profile stage fails without writing
    assert params_file.read_bytes() == before
    assert {p.name: p.read_bytes() for p in (tmp_path / "profile").iterdir()} == overlays
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_a_step_budget_below_the_batch_rows_is_refused_naming_both(params_file):
    text = params_file.read_text().replace("  max_batch_tokens: 512 ", "  max_batch_tokens: 8 ")
    params_file.write_text(text)
    with pytest.raises(ParamsError) as e:
        validate_all()
    assert "max_batch_tokens = 8 must be above batch_rows = 16" in str(e.value)
