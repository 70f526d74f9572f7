"""Profile overlays live in profiles.yaml; the active one's resolved overlay is what DVC sees (profile/<section>.yaml)."""

from __future__ import annotations

import pytest
import yaml

from chatpipe.settings import ParamsError, PretrainSettings, load_section, write_overlays


def overlay_files(tmp_path, monkeypatch, profile: str | None = None) -> dict[str, str]:
    if profile:
        monkeypatch.setenv("CHATPIPE_PROFILE", profile)
    out = tmp_path / "profile"
    return {p.stem: p.read_text() for p in write_overlays(["pretrain", "midtrain"], out_dir=out)}


def test_params_yaml_holds_no_profiles_and_overlays_still_apply(params_file, monkeypatch):
    assert "profiles" not in yaml.safe_load(params_file.read_text())
    monkeypatch.setenv("CHATPIPE_PROFILE", "d26")  # d26 extends d20
    cfg = load_section(PretrainSettings)
    assert cfg.depth == 26 and cfg.sequence_len == 2048


def test_overlay_files_follow_the_active_profile_only(params_file, tmp_path, monkeypatch):
    tiny = overlay_files(tmp_path, monkeypatch)
    assert yaml.safe_load(tiny["pretrain"]) == {}
    d26 = overlay_files(tmp_path, monkeypatch, "d26")
    resolved = yaml.safe_load(d26["pretrain"])
    assert resolved["depth"] == 26 and resolved["sequence_len"] == 2048  # the parent's values are resolved in

    # editing the active profile's parent changes the file; editing an unrelated profile does not
    profiles = params_file.with_name("profiles.yaml")
    data = yaml.safe_load(profiles.read_text())
    data["speedrun_1gpu"]["pretrain"] = {"depth": 7}
    profiles.write_text(yaml.safe_dump(data))
    assert overlay_files(tmp_path, monkeypatch, "d26") == d26
    data["d20"]["pretrain"]["sequence_len"] = 1024
    profiles.write_text(yaml.safe_dump(data))
    after = overlay_files(tmp_path, monkeypatch, "d26")
    assert yaml.safe_load(after["pretrain"])["sequence_len"] == 1024
    assert after["midtrain"] == d26["midtrain"]  # other sections' files are untouched


def test_profile_defined_twice_is_an_error(params_file):
    params_file.write_text(params_file.read_text() + "\nprofiles:\n  speedrun:\n    pretrain: {depth: 3}\n")
    with pytest.raises(ParamsError, match="both here and in"):
        load_section(PretrainSettings)


def test_unknown_section_in_profiles_file_names_the_file(params_file, monkeypatch):
    profiles = params_file.with_name("profiles.yaml")
    profiles.write_text(profiles.read_text() + "\nbroken:\n  pretrian: {depth: 3}\n")
    from chatpipe.settings import validate_all

    with pytest.raises(ParamsError, match=r"profiles\.yaml: broken has unknown section"):
        validate_all()


@pytest.mark.parametrize("profile", ["tiny", "slurm", "tiny_nanochat", "rehearsal"])
def test_cpu_profiles_split_every_training_batch_over_their_ranks(params_file, monkeypatch, profile):
    """A CPU profile's batches divide over its nodes x processes, so every stage starts (no batch-math error)."""
    from chatpipe.settings import LaunchSettings, MidtrainSettings, SFTSettings
    from chatpipe.train.step import grad_accum_steps

    monkeypatch.setenv("CHATPIPE_PROFILE", profile)
    launch = load_section(LaunchSettings)
    world = launch.nnodes * launch.nproc_per_node
    pretrain = load_section(PretrainSettings)
    grad_accum_steps(pretrain.total_batch_size, pretrain.device_batch_size, pretrain.sequence_len, world)
    for cls in (MidtrainSettings, SFTSettings):
        cfg = load_section(cls)
        grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.max_seq_len, world)
