"""Plans by cost where operators read them: ``/checkpoints/stats`` and ``/metrics`` of an app served over HTTP (a
real ``Llama`` on a tiny model, attached; the rates and plans themselves are tests/unit/test_costs.py's)."""

from __future__ import annotations

from typing import Any


def test_the_http_views_show_the_costs(make_llama: Any) -> None:
    import httpx

    import ckpt_plugin
    from ckpt_plugin.core.config import ServeSettings
    from ckpt_plugin.http.middleware import CheckpointMiddleware
    from support.apps import serve, starlette_app

    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    app = starlette_app(llama)
    app.add_middleware(CheckpointMiddleware, managers={"tiny": manager}, settings=ServeSettings(admin=True),
                       api_key="k")
    prompt = [1, *range(10, 140)]
    auth = {"Authorization": "Bearer k"}
    with serve(app) as url, httpx.Client(timeout=120) as http:
        for tail in ([], [5, 6], [5, 7]):
            assert http.post(f"{url}/v1/completions", json={"prompt": prompt + tail}, headers=auth).status_code == 200
        costs = http.get(f"{url}/checkpoints/stats", headers=auth).json()["models"]["tiny"]["costs"]
        assert costs["plans"] >= 2 and costs["recent_plans"][-1]["actual_seconds"] > 0
        assert float(costs["eval_seconds_per_token"]["1"]) > 0
        metrics = http.get(f"{url}/metrics", headers=auth).text
        assert 'ckpt_plan_time_ratio_count{model="tiny"}' in metrics
        assert 'ckpt_eval_seconds_per_token{batch="1",model="tiny"}' in metrics
