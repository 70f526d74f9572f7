"""issue 46: schemathesis against the running server's own schema, every operation, plus hand-made
malformed requests: no 5xx, every 4xx in its API's error shape, nothing wrong accepted.

The server (tiny random model) runs in its own process, started and stopped here by bench/fuzz_api.py;
``python bench/fuzz_api.py`` is the long campaign (10,000+ requests) with the same checks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis")

from chatpipe.testing.fuzz_api import campaign  # noqa: E402

OPERATIONS = {
    "GET /", "GET /health", "GET /metrics", "POST /api/chat", "GET /v1/models", "GET /v1/models/{model_id}",
    "POST /v1/chat/completions", "POST /v1/completions",
}  # fmt: skip


@pytest.mark.slow
def test_schemathesis_and_malformed_requests_find_no_5xx_bad_shape_or_wrong_answer():
    result = campaign(400)
    samples = result["samples"]
    assert set(samples["generated"]["operations"]) == OPERATIONS  # every operation was tried
    assert all("negative" in s for s in samples["generated"].get("skipped", [])), samples["generated"]["skipped"]
    for part in ("generated", "hand-made"):
        rows = result[part]
        assert rows["5xx"] == rows["bad shape"] == rows["silently wrong"] == 0, (part, rows, samples[part])
        assert rows["clean"] == rows["tried"]
    assert result["generated"]["tried"] >= 400 and result["hand-made"]["tried"] >= 50
