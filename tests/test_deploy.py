"""Prefect deployments: the served deployment and prefect.yaml describe a runnable, scheduled pipeline."""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_deployment_applies_with_schedule_tags_and_parameters(prefect_api_here):
    from prefect.client.orchestration import get_client

    from flows.deploy import build_deployment

    deployment = build_deployment(
        "nightly-test", cron="30 2 * * *", profile="tiny", stages=["tokenizer"], tags=["team-a"]
    )
    deployment_id = deployment.apply()

    async def read():
        async with get_client() as client:
            return await client.read_deployment(deployment_id)

    stored = asyncio.run(read())
    assert stored.name == "nightly-test"
    assert [s.schedule.cron for s in stored.schedules] == ["30 2 * * *"]
    assert {"chatpipe", "profile:tiny", "team-a"} <= set(stored.tags)
    assert stored.parameters["stages"] == ["tokenizer"] and stored.parameters["profile"] == "tiny"
    assert stored.entrypoint.endswith("flows/pipeline.py:pipeline")


def test_bad_stage_in_deployment_parameters_is_rejected(prefect_api_here):
    from flows.pipeline import pipeline

    with pytest.raises(ValueError, match="unknown stage"):
        pipeline.fn(stages=["pretrian"])


def test_prefect_yaml_entrypoints_resolve():
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert config["deployments"], "prefect.yaml defines no deployment"
    for d in config["deployments"]:
        path, func = d["entrypoint"].split(":")
        assert (REPO / path).exists(), d["entrypoint"]
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert hasattr(getattr(module, func), "fn"), f"{d['entrypoint']} is not a Prefect flow"
        assert d["work_pool"]["name"] == "chatpipe-local"
        assert d["parameters"]["profile"] in yaml.safe_load((REPO / "profiles.yaml").read_text()) | {"tiny": {}}
