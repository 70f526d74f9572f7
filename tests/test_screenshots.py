"""What a person sees after two pipeline runs, in a real headless Chromium: the Prefect flow-run graph,
MLflow's compare view of the two runs, and DVC's plots HTML of the two commits.

The project runs the flow twice (pretrain 8 then 16 steps) against a real Prefect server with
``--commit-lock``, so git holds both runs' dvc.lock, metrics and curves. Screenshots go to a temp dir;
with ``CHATPIPE_SCREENSHOT_DIR=docs`` they refresh the README's and docs/' images. DVC's HTML loads vega from a CDN:
offline, the test serves the same three files from ``CHATPIPE_VEGA_DIR`` (``npm pack vega@5.20.2
vega-lite@5.2.0 vega-embed@6.18.2``, unpacked as <name>-<version>/; .ci/run does this) and skips that
one screenshot, saying why, without them.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path

import pytest

from chatpipe.testing.project import BIN, dvc, make_project, project_env, run, set_params
from tests.test_prefect_schedule import Proc, free_port, wait_http

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e '.[test]')")
from tests.test_browser import CHROMIUM_ARGS, chromium_path  # noqa: E402

VEGA = {  # what dvc_render's HTML asks the CDN for -> the file npm's package holds
    "https://cdn.jsdelivr.net/npm/vega@5.20.2": "vega-5.20.2/build/vega.min.js",
    "https://cdn.jsdelivr.net/npm/vega-lite@5.2.0": "vega-lite-5.2.0/build/vega-lite.min.js",
    "https://cdn.jsdelivr.net/npm/vega-embed@6.18.2": "vega-embed-6.18.2/build/vega-embed.min.js",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two flow runs (pretrain 8 and 16 steps), each committed with --commit-lock; servers for the UIs."""
    tmp = tmp_path_factory.mktemp("screens")
    project = make_project(tmp / "project", {"pretrain": {"max_steps": 8}})
    port = free_port()
    env = project_env(project, PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the flow's stage lines reach the UI's log
    procs = [
        Proc(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            project,
            env,
            tmp / "prefect.log",
        )
    ]
    try:
        wait_http(f"{env['PREFECT_API_URL']}/health", procs[0])
        flow = [str(BIN / "python"), "-m", "flows.pipeline", "--stages", "data", "tokenizer", "pretrain"]
        api_env = {k: env[k] for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_LOGGING_LEVEL")}
        run(project, *flow, "--commit-lock", **api_env)
        set_params(project, {"pretrain": {"max_steps": 16}})
        run(project, *flow, "--commit-lock", **api_env)

        import mlflow

        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project}/mlruns/mlflow.db")
        exp = client.get_experiment_by_name("chatpipe")
        parents = client.search_runs([exp.experiment_id], "tags.stage = 'pipeline'", order_by=["start_time ASC"])
        assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)

        mlflow_port = free_port()
        procs.append(
            Proc(
                [
                    str(BIN / "mlflow"),
                    "server",
                    "--backend-store-uri",
                    f"sqlite:///{project}/mlruns/mlflow.db",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mlflow_port),
                    "--workers",
                    "1",
                ],
                project,
                env,
                tmp / "mlflow.log",
            )
        )
        wait_http(f"http://127.0.0.1:{mlflow_port}/health", procs[-1])
        yield {
            "project": project,
            "tmp": tmp,
            "prefect": env["PREFECT_API_URL"].removesuffix("/api"),
            "mlflow": f"http://127.0.0.1:{mlflow_port}",
            "experiment_id": exp.experiment_id,
            "parents": parents,
        }
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield b
        b.close()


def shot_path(name: str, tmp: Path) -> Path:
    folder = os.environ.get("CHATPIPE_SCREENSHOT_DIR")
    path = Path(folder) / name if folder else tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.slow
def test_prefect_flow_run_graph(runs, browser):
    parent = runs["parents"][-1]
    url = parent.data.tags["prefect.flow_run_url"]
    assert url.startswith(runs["prefect"])
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    page.goto(url)
    page.get_by_text(parent.data.tags["prefect.flow_run_name"]).first.wait_for(timeout=60_000)
    page.get_by_text(f"mlflow_run:{parent.info.run_id}").first.wait_for(timeout=30_000)  # the link, as a tag
    page.get_by_text("4 Task runs").first.wait_for(timeout=30_000)  # profile, data, tokenizer, pretrain
    page.wait_for_selector("canvas", timeout=30_000)  # the graph (drawn on a canvas)
    page.get_by_text("Running stage 'pretrain'").first.wait_for(timeout=30_000)  # the flow's log below it
    page.wait_for_timeout(3000)  # the graph animates into place
    page.screenshot(path=str(shot_path("prefect-flow-run.png", runs["tmp"])))
    page.close()


@pytest.mark.slow
def test_mlflow_compare_view_of_two_pipeline_runs(runs, browser):
    ids = [p.info.run_id for p in runs["parents"]]
    query = urllib.parse.urlencode({"runs": json.dumps(ids), "experiments": json.dumps([runs["experiment_id"]])})
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.goto(f"{runs['mlflow']}/#/compare-runs?{query}")
    page.get_by_text("Comparing 2 Runs").first.wait_for(timeout=60_000)
    for run_id in ids:
        page.get_by_text(run_id).first.wait_for(timeout=30_000)
    page.get_by_text("pretrain.max_steps").first.wait_for(timeout=30_000)  # the params the flow put on the parent
    page.get_by_text("pretrain.val_bpb").first.wait_for(timeout=30_000)  # and the metrics
    for switch in page.get_by_text("Show diff only").all()[:2]:  # params, metrics: pretrain.max_steps and its results
        switch.click()
    close = page.get_by_role("button", name="Close")  # the assistant side panel, if shown
    if close.count():
        close.first.click()
    page.get_by_text("Comparing 2 Runs").first.scroll_into_view_if_needed()  # the toggles scrolled the page
    page.wait_for_selector(".js-plotly-plot", timeout=30_000)  # the parallel-coordinates plot (plotly) has drawn
    page.wait_for_timeout(2000)
    page.screenshot(path=str(shot_path("mlflow-compare.png", runs["tmp"])), full_page=True)
    page.close()


@pytest.mark.slow
def test_dvc_plots_html_of_the_two_commits(runs, browser):
    vega_dir = Path(os.environ.get("CHATPIPE_VEGA_DIR", Path(__file__).parent / ".vega"))
    missing = [f for f in VEGA.values() if not (vega_dir / f).is_file()]
    if missing:
        pytest.skip(f"vega scripts not found under {vega_dir} ({missing[0]}); see this module's docstring")
    project, out = runs["project"], runs["tmp"] / "dvc-plots"
    dvc(project, "plots", "diff", "HEAD~1", "HEAD", "-o", str(out))
    metrics = json.loads(dvc(project, "metrics", "diff", "HEAD~1", "HEAD", "--json").stdout)
    assert metrics["metrics/pretrain.json"]["pretrain.tokens"]["diff"] == 8 * 1024

    page = browser.new_page(viewport={"width": 1200, "height": 900})

    def serve(path: Path):
        return lambda route, request: route.fulfill(path=str(path), content_type="text/javascript")

    for url, rel in VEGA.items():
        page.route(url, serve(vega_dir / rel))
    page.goto((out / "index.html").as_uri())
    page.wait_for_selector("canvas, svg.marks", timeout=60_000)
    assert page.locator("canvas, svg.marks").count() >= 2  # train loss and val bpb at least
    page.wait_for_timeout(1000)
    page.screenshot(path=str(shot_path("dvc-plots.png", runs["tmp"])), full_page=True)
    page.close()
