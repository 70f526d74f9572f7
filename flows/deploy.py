"""Run the pipeline on a schedule: a Prefect deployment of ``flows.pipeline:pipeline``.

    prefect server start                                   # UI at http://127.0.0.1:4200
    python -m flows.deploy --cron "0 3 * * *"              # serve: this process runs scheduled runs
    prefect work-pool create chatpipe-local --type process # or: deploy to a work pool ...
    prefect deploy --all                                   # ... from prefect.yaml
    prefect worker start --pool chatpipe-local             # ... and let a process worker run them

Both paths create the deployment ``chatpipe/<name>`` with the same parameters, tags and schedule.
"""

from __future__ import annotations

import argparse

from chatpipe.settings import dvc_stages
from flows.pipeline import pipeline

DEFAULT_TAGS = ["chatpipe", "training"]


def build_deployment(
    name: str = "nightly",
    cron: str | None = "0 3 * * *",
    profile: str = "tiny",
    stages: list[str] | None = None,
    tags: list[str] | None = None,
    work_pool: str | None = None,
):
    """The pipeline as a Prefect RunnerDeployment: schedule, parameters, tags (and work pool, if given)."""
    return pipeline.to_deployment(
        name=name,
        cron=cron,
        parameters={"profile": profile, "stages": stages, "resume_from": None},
        tags=[*DEFAULT_TAGS, f"profile:{profile}", *(tags or [])],
        description="chatpipe: tokenizer -> pretrain -> ... -> report, each stage a DVC stage launched by torchx",
        work_pool_name=work_pool,
    )


def main(argv: list[str] | None = None) -> None:
    from prefect import serve

    p = argparse.ArgumentParser(description="Serve the chatpipe pipeline on a cron schedule.")
    p.add_argument("--name", default="nightly")
    p.add_argument("--cron", default="0 3 * * *", help="cron schedule (server time zone)")
    p.add_argument("--profile", default="tiny")
    p.add_argument("--stages", nargs="+", choices=dvc_stages())
    p.add_argument("--tag", action="append", default=[], help="extra deployment tag (repeatable)")
    args = p.parse_args(argv)
    serve(build_deployment(args.name, args.cron, args.profile, args.stages, args.tag))


if __name__ == "__main__":
    main()
